"""fp16 I/O host steps: gradients read from the fp16 staging buffer, the upload copy written
in the same pass (a plan's ``PlanOptions.fp16_io``, [Note: fp16 I/O steps] in stepping.py).

The contract is bit-identity with the three-pass route it replaces (widen, single-pass
step, narrow): every loss, master, moment, step count and loss scale of a run equals the
run without fp16 I/O, with speculation and overflow undo, accumulation, inline or threaded
host work. The mixed plan of optim_helpers has offloaded and resident host-state regions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from optim_helpers import batch, loss_of, offload_module, tiny_gpt2
from test_speculate import Trainer, assert_same, run

from offload_optim import AMPOptimizer, HybridAdam, OverlapMode
from offload_runtime import OffloadConfig
from offload_runtime.host_kernels import AdamHyper, single_pass
from offload_solver import PlanOptions

pytestmark = pytest.mark.skipif(
    not single_pass.fp16_io_available(), reason="numba or the CPU's fp16 conversions missing"
)

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts the fp16-I/O kernel launches (plain and speculative) HybridAdam makes."""
    calls = {"plain": 0, "speculative": 0}

    def wrap(name: str, kind: str) -> None:
        inner: Callable[..., Any] = getattr(single_pass, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[kind] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(single_pass, name, counting)

    wrap("adam_fp16_io_", "plain")
    wrap("speculative_adam_fp16_io_", "speculative")
    yield calls


MOMENTS = [torch.float32, torch.bfloat16]


def _state(
    n: int, seed: int, moments: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = (torch.randn(n, generator=gen) * 1e-3).to(moments)
    v = (torch.rand(n, generator=gen) * 1e-6).to(moments)
    g16 = (torch.randn(n, generator=gen) * 300).half()
    g16[:4] = torch.tensor([0.0, -0.0, 6e-8, -65504.0])  # zero, subnormal, largest
    return p, m, v, g16


@pytest.mark.parametrize("moments", MOMENTS)
def test_fp16_io_kernel_equals_widen_step_narrow_bit_for_bit(moments: torch.dtype) -> None:
    """Several work items and a ragged tail; the upload copy written over the gradient."""
    n = 3 * (1 << 16) + 7
    p, m, v, g16 = _state(n, 0, moments)
    scale = torch.tensor(256.0)
    step = torch.tensor(5.0)
    ref = [t.clone() for t in (p, m, v)]
    single_pass.adam_(ref[0], g16.float(), ref[1], ref[2], step, HYPER, scale)
    got = [t.clone() for t in (p, m, v)]
    shared = g16.clone()  # grad16 and param16 the same buffer, as for a resident region
    single_pass.adam_fp16_io_(got[0], shared, got[1], got[2], shared, step, HYPER, scale)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert torch.equal(shared, ref[0].half())
    assert not torch.equal(ref[0], p), "the step changed the master"


@pytest.mark.parametrize("moments", MOMENTS)
def test_speculative_fp16_io_kernel_keeps_the_undo_data_and_flags_overflow(
    moments: torch.dtype,
) -> None:
    n = 2 * (1 << 16) + 3
    p, m, v, g16 = _state(n, 1, moments)
    m0, v0 = m.clone(), v.clone()
    step = torch.tensor(2.0)
    ref = [t.clone() for t in (p, m, v)]
    single_pass.adam_(ref[0], g16.float(), ref[1], ref[2], step, HYPER)
    master, bak = p.clone(), torch.empty(n)
    nm, nv = torch.empty(n, dtype=moments), torch.empty(n, dtype=moments)
    out16 = torch.empty(n, dtype=torch.float16)
    part = single_pass.speculative_adam_fp16_io_(master, g16, m, v, nm, nv, bak, out16, step, HYPER)
    assert float(part) == 0.0
    assert torch.equal(master, ref[0]) and torch.equal(out16, ref[0].half())
    assert torch.equal(nm, ref[1]) and torch.equal(nv, ref[2])
    assert torch.equal(bak, p), "the backup holds the master before the step"
    assert torch.equal(m, m0) and torch.equal(v, v0), "the old moments are only read"
    g16[n - 1] = math.inf  # the last element of the ragged tail
    part = single_pass.speculative_adam_fp16_io_(master, g16, m, v, nm, nv, bak, out16, step, HYPER)
    assert math.isinf(float(part))


@pytest.mark.parametrize("moments", MOMENTS)
@pytest.mark.parametrize("offset", [0, 1, 3, 15])
def test_speculative_kernels_stream_their_undo_data_at_any_alignment(
    offset: int, moments: torch.dtype
) -> None:
    """The undo buffers and the fp16 upload copy are written with aligned non-temporal
    stores between scalar heads and tails: buffers starting ``offset`` elements past a
    64-byte boundary (views into a larger tensor) get every element, as the in-place
    kernels compute them."""
    n = 2 * (1 << 16) + 37
    p, m, v, g16 = _state(n, 2, moments)
    step = torch.tensor(3.0)
    ref = [t.clone() for t in (p, m, v)]
    single_pass.adam_(ref[0], g16.float(), ref[1], ref[2], step, HYPER)

    def views() -> list[torch.Tensor]:
        dtypes = (moments, moments, torch.float32)  # next moments, backup
        return [torch.full((n + 32,), math.nan, dtype=d)[offset : offset + n] for d in dtypes]

    nm, nv, bak = views()
    master = p.clone()
    single_pass.speculative_adam_(master, g16.float(), m, v, nm, nv, bak, step, HYPER)
    assert torch.equal(master, ref[0]) and torch.equal(bak, p)
    assert torch.equal(nm, ref[1]) and torch.equal(nv, ref[2])
    nm, nv, bak = views()
    master = p.clone()
    out16 = torch.full((n + 32,), math.nan, dtype=torch.float16)[offset : offset + n]
    single_pass.speculative_adam_fp16_io_(master, g16, m, v, nm, nv, bak, out16, step, HYPER)
    assert torch.equal(master, ref[0]) and torch.equal(bak, p)
    assert torch.equal(nm, ref[1]) and torch.equal(nv, ref[2])
    assert torch.equal(out16, ref[0].half())
    # The plain fp16-I/O step streams its upload copy the same way.
    got = [t.clone() for t in (p, m, v)]
    out16.fill_(math.nan)
    single_pass.adam_fp16_io_(got[0], g16, got[1], got[2], out16, step, HYPER)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert torch.equal(out16, ref[0].half())


CASES: dict[str, dict[str, Any]] = {
    "threaded": {},
    "bf16_moments": {"moments": torch.bfloat16},
    "bf16_moments_speculate": {"moments": torch.bfloat16, "speculate": True},
    "inline": {"host_worker": False},
    "speculate": {"speculate": True},
    "speculate_on_a_thread": {"speculate": True, "speculation_thread": True},
    "accumulate_2": {"micro": 2},
    "no_overlap": {"overlap": False},
}


@pytest.mark.parametrize("micro", [1, 2])
def test_staged_gradients_are_widened_only_when_added_to(micro: int) -> None:
    """Each backward after zero_grad overwrites the staged gradients: no widening pass.
    Only a micro-batch that adds to them (accumulation) has them widened first: once per
    host-state region and window."""
    trainer = Trainer(False, host_kernel="single_pass", fp16_io=True, micro=micro)
    try:
        trainer.train(range(4))
        stats = trainer.module.controller.stats
        host = [st for st in trainer.module.storages if st.host_state]
    finally:
        trainer.close()
    assert stats["grads_to_staging"] == 4 * micro * len(host)
    assert stats["staged_grads_widened_late"] == (0 if micro == 1 else 4 * len(host))


@pytest.mark.parametrize("name", list(CASES))
def test_training_equals_the_three_pass_route(name: str, counted: dict[str, int]) -> None:
    kwargs = dict(CASES[name])
    speculate = kwargs.pop("speculate", False)
    steps = 9
    growth: dict[str, Any] = {"growth_interval": 3, "initial_scale": 2.0**8}
    io = run(speculate, steps, host_kernel="single_pass", fp16_io=True, **kwargs, **growth)
    launched = dict(counted)
    plain = run(speculate, steps, host_kernel="single_pass", **kwargs, **growth)
    assert_same(io, plain)
    assert dict(counted) == launched, "the run without fp16_io launched no fp16-I/O kernel"
    if "micro" in kwargs:
        # Accumulation: each micro-batch after the first adds to the accumulator, so the
        # runtime widens the staged gradients before its copy, and the fp32 kernel steps.
        assert launched["plain"] + launched["speculative"] == 0
    else:
        assert launched["plain"] + launched["speculative"] > 0
    if speculate:
        assert launched["speculative"] > 0
        # The first window answers first and steps nothing early (clipping on demand).
        assert io.modes == {OverlapMode.DEVICE_ANSWER, OverlapMode.SPECULATIVE_UNDO}
    assert io.scales[-1] > io.scales[0] and sum(io.losses[-3:]) < sum(io.losses[:3])


@pytest.mark.parametrize("speculation_thread", [False, True])
def test_overflow_undo_restores_the_offloaded_upload_copy(
    counted: dict[str, int], speculation_thread: bool
) -> None:
    """Speculative fp16-I/O steps write the upload copy; an overflow undoes them, and the
    next forward must compute with the old weights: the rest of the run equals the run
    without speculation or fp16 I/O, bit for bit. With ``speculation_thread`` the steps
    run on their own thread, beside backward."""
    common: dict[str, Any] = {"host_worker": False, "hysteresis": 1}
    trainer = Trainer(
        True,
        host_kernel="single_pass",
        fp16_io=True,
        speculation_thread=speculation_thread,
        **common,
    )
    trainer.poison_steps = {2}
    try:
        out = trainer.train(range(6))
        offloaded = [st for st in trainer.module.storages if st.host_state and st.offloaded]
        assert offloaded, "the plan offloads a host-state region"
        for st in offloaded:
            assert st.host_params is not None
            assert torch.equal(st.host_params, st.master.half())
    finally:
        trainer.close()
    assert counted["speculative"] > 0
    assert out.skipped == [False, False, True, False, False, False]
    plain = run(False, 6, poison=(2,), host_kernel="single_pass", **common)
    assert_same(out, plain)


def _module_and_amp(fp16_io: bool) -> tuple[Any, AMPOptimizer]:
    module = offload_module(
        tiny_gpt2(),
        batch(0),
        dtype=torch.float16,
        host_worker=True,
        options=PlanOptions(host_kernel="single_pass", fp16_io=fp16_io),
        config=OffloadConfig(accumulation_steps=3),
    )
    opt = HybridAdam(module.parameters(), lr=1e-2)
    return module, AMPOptimizer(opt, module)


def test_gradients_read_between_backward_and_step_are_widened() -> None:
    """named_gradients(), zero_grad(set_to_none=False) and a second backward without
    zero_grad see what they see without fp16 I/O."""
    results = []
    for fp16_io in (True, False):
        module, amp = _module_and_amp(fp16_io)
        try:
            b = batch(0)
            amp.backward(loss_of(module(**b), b["input_ids"]))
            grads = {k: g.clone() for k, g in module.named_gradients()}
            amp.optimizer.zero_grad(set_to_none=False)
            zeroed = [g.abs().sum().item() for _, g in module.named_gradients()]
            b = batch(1)
            amp.backward(loss_of(module(**b), b["input_ids"]))
            b = batch(2)
            amp.backward(loss_of(module(**b), b["input_ids"]))  # adds to the first
            summed = {k: g.clone() for k, g in module.named_gradients()}
            amp.step()
            weights = {k: p.detach().clone() for k, p in module.named_parameters()}
            results.append((grads, zeroed, summed, weights))
        finally:
            module.close()
    (g1, z1, s1, w1), (g2, z2, s2, w2) = results
    assert g1.keys() == g2.keys() and all(torch.equal(g1[k], g2[k]) for k in g1)
    assert z1 == z2 == [0.0] * len(z1)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert any(not torch.equal(s1[k], g1[k]) for k in s1), "the second backward added"
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_fp16_io_refuses_what_it_cannot_step() -> None:
    """fp16 I/O is a plan of the single-pass kernel converting on the host (the plan's
    options refuse the rest), for an fp16 module (the module refuses another dtype)."""
    with pytest.raises(ValueError, match="host_kernel='single_pass'"):
        PlanOptions(fp16_io=True)
    with pytest.raises(ValueError, match="convert_on_device=False"):
        PlanOptions(host_kernel="single_pass", fp16_io=True, convert_on_device=True)
    io = PlanOptions(host_kernel="single_pass", fp16_io=True)
    with pytest.raises(ValueError, match="float16 training only"):
        offload_module(tiny_gpt2(), batch(0), dtype=torch.bfloat16, options=io)
