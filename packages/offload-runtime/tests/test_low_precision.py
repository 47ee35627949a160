"""bf16-master host Adam (host_kernels.low_precision): the numba kernels against their
torch references, the master's rounding, the 8-bit moments' error and training quality,
and argument validation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from offload_runtime.host_kernels import AdamHyper, low_precision, single_pass
from offload_runtime.host_kernels.low_precision import (
    QBLOCK,
    QUANT_DTYPES,
    adam_bf16_,
    adam_bf16_8bit_,
    dequantize_moments,
    quantize_moments_,
    quantized_numel,
    reference_adam_bf16_,
    reference_adam_bf16_8bit_,
    round_bf16,
    seed_key,
)
from offload_solver import HOST_STATE_BYTES

LENGTHS = (1, 255, 257, 70_003)
"""Odd lengths: one element, a partial quantization block, one block and a bit, and past
the first numba block (65536 elements) with a ragged tail."""

ADAMW = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
ADAM_L2 = AdamHyper(lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, adamw=False)

ROUND_TRIP_SLACK = 1e-5
"""Relative slack on the 8-bit round-trip bound for fp32 rounding of the coding."""

QUALITY_TOLERANCE = 0.02
"""Largest relative difference of the final loss of the classifier below, each bf16-master
rung against fp32 AdamW (the bound planned for a small GPT; measured here: under 0.01)."""


@contextmanager
def threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits, for comparisons that tell -0 from 0 and see every ulp."""
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16)
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t


def ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in their order, neighbours one apart (-0 and 0 both 0)."""
    b = t.view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, i
        assert torch.equal(bits(a), bits(b)), (i, int((bits(a) != bits(b)).sum()))


def bf16_state(n: int, grad_dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen).bfloat16()
    grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    m = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    v = (torch.rand(n, generator=gen) * 1e-3).bfloat16()
    return [master, grad, m, v]


def quantized_state(n: int, grad_dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    master, grad, m, v = bf16_state(n, grad_dtype, seed)
    k = quantized_numel(n)
    state = [torch.empty(n, dtype=torch.int8), torch.empty(k), torch.empty(n, dtype=torch.uint8)]
    state.append(torch.empty(k))
    quantize_moments_(m, v, *state)
    return [master, grad, *state]


def clones(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in ts]


Kernel = Callable[..., None]


def run_steps(
    kernel: Kernel,
    state: list[torch.Tensor],
    hyper: AdamHyper,
    scale: float | None = None,
    **kw: object,
) -> None:
    """Three steps, each with its own seed (and gradient scale: ``scale`` times the step)."""
    for step in range(1, 4):
        grad_scale = None if scale is None else torch.tensor(scale * step)
        kernel(*state, torch.tensor(float(step)), hyper, grad_scale, **kw, seed=step * 7)


# numba against the torch reference


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hyper", [ADAMW, ADAM_L2], ids=["adamw", "l2"])
@pytest.mark.parametrize("scale", [None, 2.0], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_bf16_kernel_equals_the_reference_bit_for_bit(
    grad_dtype: torch.dtype, hyper: AdamHyper, scale: float | None, stochastic: bool
) -> None:
    pytest.importorskip("numba")
    for n in LENGTHS:
        state = bf16_state(n, grad_dtype)
        want = clones(state)
        run_steps(reference_adam_bf16_, want, hyper, scale=scale, stochastic=stochastic)
        for count in (1, 2):
            got = clones(state)
            with threads(count):
                run_steps(adam_bf16_, got, hyper, scale=scale, stochastic=stochastic)
            assert_same(got, want)
        assert torch.equal(want[1], state[1]), "the gradient is only read"


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hyper", [ADAMW, ADAM_L2], ids=["adamw", "l2"])
@pytest.mark.parametrize("scale", [None, 2.0], ids=["unscaled", "scaled"])
def test_8bit_kernel_equals_the_reference_bit_for_bit(
    grad_dtype: torch.dtype, hyper: AdamHyper, scale: float | None
) -> None:
    pytest.importorskip("numba")
    for n in LENGTHS:
        state = quantized_state(n, grad_dtype)
        want = clones(state)
        run_steps(reference_adam_bf16_8bit_, want, hyper, scale=scale)
        for count in (1, 2):
            got = clones(state)
            with threads(count):
                run_steps(adam_bf16_8bit_, got, hyper, scale=scale)
            assert_same(got, want)
        assert not torch.equal(want[3], state[3]), "the moments moved"


def test_without_numba_the_public_kernels_run_the_references(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state, qstate = bf16_state(300, torch.float32), quantized_state(300, torch.bfloat16)
    want, qwant = clones(state), clones(qstate)
    run_steps(reference_adam_bf16_, want, ADAMW, stochastic=True)
    run_steps(reference_adam_bf16_8bit_, qwant, ADAMW)
    monkeypatch.setattr(single_pass, "available", lambda: False)
    run_steps(adam_bf16_, state, ADAMW, stochastic=True)
    run_steps(adam_bf16_8bit_, qstate, ADAMW)
    assert_same(state, want)
    assert_same(qstate, qwant)


# rounding the master


@pytest.mark.parametrize("hyper", [ADAMW, ADAM_L2], ids=["adamw", "l2"])
def test_nearest_rounding_is_torch_adam_in_fp32_rounded_to_bf16(hyper: AdamHyper) -> None:
    """One step equals torch.optim's AdamW / Adam (fp32, for-loop implementation) on the
    widened master and moments, each result rounded to bf16: the same bits but for a
    bf16 ulp where torch's operation order or its fp32 sqrt rounds the other way."""
    n = 70_003
    master, grad, m, v = bf16_state(n, torch.bfloat16, seed=3)
    old = clones([master, grad, m, v])
    step = 5
    p32 = torch.nn.Parameter(master.float())
    p32.grad = grad.float()
    kind = torch.optim.AdamW if hyper.adamw else torch.optim.Adam
    opt = kind(
        [p32], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
        weight_decay=hyper.weight_decay, foreach=False, fused=False,
    )  # fmt: skip
    opt.state[p32] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": m.float(),
        "exp_avg_sq": v.float(),
    }
    opt.step()
    adam_bf16_(master, grad, m, v, torch.tensor(float(step)), hyper, stochastic=False, seed=0)
    state = opt.state[p32]
    # Where a result cancels to near zero (m's lerp), torch's FMA and our two roundings
    # differ by fp32 ulps of the operands: many bf16 ulps of the tiny result.
    operands = (
        (master, p32.detach(), old[0].float().abs()),
        (m, state["exp_avg"], grad.float().abs() + old[2].float().abs() + old[0].float().abs()),
        (v, state["exp_avg_sq"], old[3].float() + grad.float() ** 2),
    )
    for got, want, size in operands:
        ulps = (ordered(got) - ordered(want.bfloat16())).abs()
        cancelled = (got.float() - want).abs() <= 2.0**-20 * size
        assert bool(((ulps <= 1) | cancelled).all())
        assert float((ulps == 0).float().mean()) > 0.99


def test_stochastic_rounding_is_unbiased_deterministic_and_seeded() -> None:
    ulp = 2.0**-7  # of bf16 in [1, 2)
    for frac in (0.3, 0.5, 0.9):
        x = torch.full((1 << 16,), 1.5 + frac * ulp)
        ups = (round_bf16(x, 0, seed_key(11)).float() > 1.5).float()
        # Over elements: the mean's standard error is sqrt(p (1 - p) / 65536) < 0.002.
        assert abs(float(ups.mean()) - frac) < 0.01
        # Over seeds, one element.
        one = x[:1]
        seeds = [(round_bf16(one, 12345, seed_key(s)).float() > 1.5).item() for s in range(4000)]
        assert abs(sum(seeds) / len(seeds) - frac) < 0.03  # 3.9 standard errors
    x = torch.randn(10_000)
    assert torch.equal(bits(round_bf16(x, 0, None)), bits(x.bfloat16())), "nearest is torch's"
    a, b = round_bf16(x, 0, seed_key(1)), round_bf16(x, 0, seed_key(1))
    assert torch.equal(bits(a), bits(b))
    c = round_bf16(x, 0, seed_key(2))
    assert float((bits(a) != bits(c)).float().mean()) > 0.3
    # Each result is one of the two bf16 neighbours.
    down = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    up = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    got = a.float()
    assert bool(((got == down) | (got == up)).all())
    # The hash reaches elements past 2**32 (another word for the high half).
    far = round_bf16(x[:4096], (1 << 32) + 5, seed_key(1))
    assert not torch.equal(bits(far), bits(round_bf16(x[:4096], 5, seed_key(1))))


def test_stochastic_rounding_keeps_special_values() -> None:
    big = float(torch.finfo(torch.bfloat16).max)
    x = torch.tensor([math.inf, -math.inf, math.nan, big, -big, 0.0, -0.0, 1e-40] * 4096)
    for seed in range(4):
        got = round_bf16(x, 0, seed_key(seed))
        assert torch.equal(got[0::8], torch.full((4096,), math.inf, dtype=torch.bfloat16))
        assert torch.equal(got[1::8], torch.full((4096,), -math.inf, dtype=torch.bfloat16))
        assert bool(got[2::8].isnan().all())
        assert bool((got[3::8].float() == big).all()), "the largest value never overflows"
        assert bool((got[4::8].float() == -big).all())
        assert torch.equal(bits(got[5::8]), bits(torch.zeros(4096, dtype=torch.bfloat16)))
        assert bool(torch.signbit(got[6::8]).all()) and bool((got[6::8] == 0).all())
    # A quarter of an ulp beyond the largest value overflows a quarter of the time.
    beyond = (torch.tensor([big]).view(torch.int32) + 0x4000).view(torch.float32)
    got = round_bf16(beyond.expand(1 << 16).contiguous(), 0, seed_key(3)).float()
    assert bool(((got == big) | (got == math.inf)).all())
    assert abs(float((got == math.inf).float().mean()) - 0.25) < 0.01


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_the_kernels_round_special_values_alike(stochastic: bool) -> None:
    """With beta1 = beta2 = 0 and no decay, the step moves each element by exactly lr
    against its gradient's sign. Pushed a quarter ulp beyond the largest bf16 value, a
    value stays there (nearest) or overflows a quarter of the time (stochastic); pushed
    past fp32's range, it is inf, which stays inf; NaN stays NaN (bits 0x7FC0). numba
    and the reference agree bit for bit."""
    big = float(torch.finfo(torch.bfloat16).max)
    reps = 4096
    master = torch.tensor([math.nan, big, -big, 0.0] * reps).bfloat16()
    grad = torch.tensor([1.0, -1.0, 1.0, 1.0] * reps).bfloat16()
    kernels = [reference_adam_bf16_]
    if single_pass.available():
        kernels.append(adam_bf16_)
    # A quarter of bf16's ulp at its largest value (2**120), and past fp32's largest value.
    for lr in (2.0**118, 2.0**127):
        hyper = AdamHyper(lr=lr, beta1=0.0, beta2=0.0, eps=1e-30, weight_decay=0.0, adamw=True)
        results = []
        for kernel in kernels:
            state = [master.clone(), grad]
            state += [torch.zeros(4 * reps, dtype=torch.bfloat16) for _ in range(2)]
            kernel(*state, torch.tensor(1.0), hyper, stochastic=stochastic, seed=4)
            results.append(state[0])
        assert_same(results, [results[0]] * len(results))
        got = results[0].float()
        assert torch.equal(bits(results[0][0::4]), torch.full((reps,), 0x7FC0, dtype=torch.int16))
        assert bool((got[3::4] == -lr).all())
        outward = torch.cat([got[1::4], -got[2::4]])
        if lr == 2.0**127:
            assert bool((outward == math.inf).all())
            continue
        assert bool(((outward == big) | (outward == math.inf)).all())
        overflowed = float((outward == math.inf).float().mean())
        assert overflowed == 0.0 if not stochastic else abs(overflowed - 0.25) < 0.02


@pytest.mark.parametrize("kernel", [adam_bf16_, reference_adam_bf16_])
def test_stochastic_rounding_keeps_updates_below_half_an_ulp(kernel: Kernel) -> None:
    """Step 1 moves every element by lr (m_hat / sqrt(v_hat) = sign(g)); 0.3 ulp here.
    Nearest rounding loses the update, stochastic rounding keeps it in expectation."""
    n = 1 << 16
    lr = 0.3 * 2.0**-7
    hyper = AdamHyper(lr=lr, beta1=0.9, beta2=0.999, eps=1e-12, weight_decay=0.0, adamw=True)
    for stochastic in (False, True):
        master = torch.full((n,), 1.5, dtype=torch.bfloat16)
        zeros = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
        grad = torch.ones(n)
        kernel(master, grad, *zeros, torch.tensor(1.0), hyper, stochastic=stochastic, seed=9)
        moved = 1.5 - float(master.float().mean())
        if stochastic:
            assert abs(moved - lr) < 0.03 * lr
        else:
            assert moved == 0.0


# 8-bit moments


def wide_range_moments(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Moments whose magnitudes span eight decades, block scales spanning six, some exact
    zeros and one all-zero block."""
    gen = torch.Generator().manual_seed(5)
    blocks = quantized_numel(n)
    block_scale = 10.0 ** (-6 * torch.rand(blocks, generator=gen)).repeat_interleave(QBLOCK)[:n]
    mag = 10.0 ** (-8 * torch.rand(n, generator=gen))
    m = torch.randn(n, generator=gen).sign() * mag * block_scale
    v = (10.0 ** (-8 * torch.rand(n, generator=gen))) ** 2 * block_scale
    m[::97] = 0.0
    v[::89] = 0.0
    m[QBLOCK : 2 * QBLOCK] = 0.0
    v[QBLOCK : 2 * QBLOCK] = 0.0
    return m, v


def test_8bit_round_trip_error_is_bounded() -> None:
    """|m - m'| <= a (sqrt(|m| / a) / 127 + 1 / (4 * 127**2)) and |v - v'| <=
    max(2 a (y + 1/510)**3 / 255, a / 255**4) with y = (v / a)**0.25, ``a`` the block's
    absmax (the bounds of [Note: bf16 master weights]); zero blocks and zeros stay zero,
    the block's largest value is exact to an fp32 ulp, and a nonzero v never decodes to
    zero."""
    n = 40 * QBLOCK + 77
    m, v = wide_range_moments(n)
    k = quantized_numel(n)
    mq, ms = torch.empty(n, dtype=torch.int8), torch.empty(k)
    vq, vs = torch.empty(n, dtype=torch.uint8), torch.empty(k)
    quantize_moments_(m, v, mq, ms, vq, vs)
    m2, v2 = dequantize_moments(mq, ms, vq, vs)

    def per_element(scale: torch.Tensor) -> torch.Tensor:
        return scale.repeat_interleave(QBLOCK)[:n].double()

    am, av = per_element(ms), per_element(vs)
    assert torch.equal(ms, torch.stack([b.abs().max() for b in m.split(QBLOCK)]))
    assert torch.equal(vs, torch.stack([b.max() for b in v.split(QBLOCK)]))
    safe_m, safe_v = am.clamp_min(1e-300), av.clamp_min(1e-300)
    m_bound = am * ((m.abs().double() / safe_m).sqrt() / 127 + 1 / (4 * 127**2))
    y = (v.double() / safe_v) ** 0.25
    v_bound = torch.maximum(2 * av * (y + 1 / 510) ** 3 / 255, av / 255**4)
    m_err = (m.double() - m2.double()).abs()
    v_err = (v.double() - v2.double()).abs()
    assert bool((m_err <= m_bound * (1 + ROUND_TRIP_SLACK)).all())
    assert bool((v_err <= v_bound * (1 + ROUND_TRIP_SLACK)).all())
    # Where the value is within 1% of the absmax and above, the error is about a code.
    top = (m.abs().double() >= 0.5 * am) & (am > 0)
    assert float((m_err[top] / m.abs().double()[top]).max()) < 0.012
    top = (v.double() >= 0.5 * av) & (av > 0)
    assert float((v_err[top] / v.double()[top]).max()) < 0.02
    assert bool((m2[QBLOCK : 2 * QBLOCK] == 0).all()) and bool((v2[QBLOCK : 2 * QBLOCK] == 0).all())
    assert float(ms[1]) == 0.0 and float(vs[1]) == 0.0
    assert bool((m2[m == 0] == 0).all()) and bool((v2[v == 0] == 0).all())
    assert bool((v2[v > 0] > 0).all()), "a nonzero second moment never decodes to zero"
    block_max = m.abs().view(-1)[: 40 * QBLOCK].view(40, QBLOCK).amax(dim=1)
    got_max = m2.abs()[: 40 * QBLOCK].view(40, QBLOCK).amax(dim=1)
    assert torch.allclose(got_max, block_max, rtol=2**-23, atol=0.0)


def test_8bit_zero_state_steps_from_zero_and_zero_gradients_keep_it_zero() -> None:
    n = 3 * QBLOCK + 5
    k = quantized_numel(n)
    master = torch.randn(n).bfloat16()
    state = [torch.zeros(n, dtype=torch.int8), torch.zeros(k), torch.zeros(n, dtype=torch.uint8)]
    state.append(torch.zeros(k))
    grad = torch.zeros(n)
    grad[QBLOCK : 2 * QBLOCK] = torch.randn(QBLOCK)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    before = master.clone()
    adam_bf16_8bit_(master, grad, *state, torch.tensor(1.0), hyper, seed=1)
    m, v = dequantize_moments(*state)
    assert float(state[1][0]) == 0.0 and float(state[3][2]) == 0.0
    assert bool((m[:QBLOCK] == 0).all()) and bool((v[2 * QBLOCK :] == 0).all())
    assert torch.equal(master[:QBLOCK], before[:QBLOCK]), "no gradient, no decay: no update"
    assert not torch.equal(master[QBLOCK : 2 * QBLOCK], before[QBLOCK : 2 * QBLOCK])


def classifier_losses(optimizer: str, steps: int = 300) -> tuple[float, float]:
    """(first loss, mean of the last 20) of a small MLP classifier trained full-batch on
    labels sampled from a teacher network's softmax, with fp32 AdamW or a bf16-master
    kernel fed bf16 gradients ("nearest", "stochastic" or "8bit"). The labels' own entropy
    keeps the loss far above zero, as a language model's is, so the comparison measures
    the optimizer, not how closely bf16 weights can pin a minimum."""
    torch.manual_seed(0)
    x = torch.randn(4096, 16)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    with torch.no_grad():
        labels = torch.distributions.Categorical(logits=teacher(x) * 3).sample()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    params = list(model.parameters())
    for p in params:
        p.data = p.data.bfloat16().float()  # one start for every optimizer
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    reference = torch.optim.AdamW(params, lr=hyper.lr, weight_decay=hyper.weight_decay)
    states = []
    for p in params:
        n, k = p.numel(), quantized_numel(p.numel())
        if optimizer == "8bit":
            moments = [torch.zeros(n, dtype=torch.int8), torch.zeros(k)]
            moments += [torch.zeros(n, dtype=torch.uint8), torch.zeros(k)]
        else:
            moments = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
        states.append((p.detach().bfloat16().view(-1).clone(), moments))
    losses = []
    for step in range(1, steps + 1):
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        model.zero_grad()
        loss.backward()
        losses.append(float(loss.detach()))
        if optimizer == "fp32":
            reference.step()
            continue
        for i, (p, (master, moments)) in enumerate(zip(params, states, strict=True)):
            assert p.grad is not None
            grad = p.grad.view(-1).bfloat16()
            count, seed = torch.tensor(float(step)), step * 100 + i
            if optimizer == "8bit":
                adam_bf16_8bit_(master, grad, *moments, count, hyper, seed=seed)
            else:
                stochastic = optimizer == "stochastic"
                adam_bf16_(master, grad, *moments, count, hyper, stochastic=stochastic, seed=seed)
            p.data.copy_(master.view_as(p))
    return losses[0], sum(losses[-20:]) / 20


def test_bf16_master_trains_as_fp32_adamw() -> None:
    first, fp32 = classifier_losses("fp32")
    assert fp32 < 0.8 * first, "the classifier must actually train"
    for rung in ("nearest", "stochastic", "8bit"):
        _, loss = classifier_losses(rung)
        assert abs(loss / fp32 - 1) < QUALITY_TOLERANCE, (rung, loss, fp32)


# arguments


def test_sizes_and_bytes() -> None:
    assert [quantized_numel(n) for n in (0, 1, 256, 257, 70_003)] == [0, 1, 1, 2, 274]
    # The solver's bytes per parameter are the kernels' arrays: the bf16 gradient read,
    # the master read and written, each moment (bf16, or one 8-bit code) read and written.
    grad, master = 2, 2 * 2
    assert HOST_STATE_BYTES["bf16_nearest"] == HOST_STATE_BYTES["bf16_stochastic"]
    assert HOST_STATE_BYTES["bf16_nearest"] == grad + master + 2 * 2 * 2
    assert HOST_STATE_BYTES["bf16_8bit"] == grad + master + 2 * 2 * QUANT_DTYPES[0].itemsize
    assert seed_key(1) != seed_key(2) and seed_key(-1) == seed_key(2**64 - 1)
    assert all(0 <= k < 2**32 for k in seed_key(123))


@pytest.mark.parametrize("numba_kernels", [True, False], ids=["public", "reference"])
def test_bad_arguments_raise_value_error(numba_kernels: bool) -> None:
    bf16_step: Kernel = adam_bf16_ if numba_kernels else reference_adam_bf16_
    q_step: Kernel = adam_bf16_8bit_ if numba_kernels else reference_adam_bf16_8bit_
    n = 300
    good = bf16_state(n, torch.float32)
    one = torch.tensor(1.0)
    bad_cases = [
        [good[0].float(), *good[1:]],  # an fp32 master
        [good[0], good[1].half(), *good[2:]],  # an fp16 gradient
        [*good[:2], good[2].float(), good[3]],  # fp32 moments
        [torch.randn(2 * n).bfloat16()[::2], *good[1:]],  # a strided master
        [good[0], good[1][:-1], *good[2:]],  # a short gradient
        [*good[:3], good[3][:-1]],
    ]
    for case in bad_cases:
        with pytest.raises(ValueError):
            bf16_step(*case, one, ADAMW, stochastic=True, seed=0)
    qgood = quantized_state(n, torch.bfloat16)
    k = quantized_numel(n)
    qbad = [
        [*qgood[:2], qgood[2].view(torch.uint8), *qgood[3:]],  # uint8 first moment
        [*qgood[:4], qgood[4].view(torch.int8), qgood[5]],  # int8 second moment
        [*qgood[:3], torch.zeros(k + 1), *qgood[4:]],  # one scale too many
        [*qgood[:5], torch.zeros(k, dtype=torch.float64)],
        [*qgood[:2], torch.zeros(n - 1, dtype=torch.int8), *qgood[3:]],
        [qgood[0].float(), *qgood[1:]],
    ]
    for case in qbad:
        with pytest.raises(ValueError):
            q_step(*case, one, ADAMW, seed=0)
    m, v = torch.zeros(n), torch.zeros(n)
    with pytest.raises(ValueError):
        quantize_moments_(m, v[:-1], *qgood[2:])
    with pytest.raises(ValueError):
        dequantize_moments(qgood[2], qgood[3][:-1], qgood[4], qgood[5])


def test_the_reference_bounds_its_memory() -> None:
    assert low_precision.REFERENCE_CHUNK % QBLOCK == 0
