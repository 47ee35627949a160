"""The bf16-master rungs of the host-state ladder (``OffloadConfig.host_state``): where the
state lives, what a step computes, checkpoints, and accumulation."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import batch, fell, loss_of, offload_module, tiny_gpt2, train_offload

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig
from offload_runtime.host_kernels import low_precision
from offload_runtime.storage import required_host_bytes

BF16_MASTER = ("bf16_stochastic", "bf16_8bit", "bf16_nearest")


def _module(state: str, **kw: object) -> tuple[object, AMPOptimizer]:
    config = OffloadConfig(dtype=torch.bfloat16, host_state=state)
    module = offload_module(
        tiny_gpt2(), batch(0), dtype=torch.bfloat16, all_host_state=True, config=config, **kw
    )
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
    return module, amp


def test_a_bf16_master_rung_needs_bf16_training() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch\.bfloat16"):
        OffloadConfig(host_state="bf16_stochastic")
    with pytest.raises(ValueError, match="host_state"):
        OffloadConfig(dtype=torch.bfloat16, host_state="int4")


@pytest.mark.parametrize("state", BF16_MASTER)
def test_host_masters_are_bf16_and_their_own_upload_copy(state: str) -> None:
    module, amp = _module(state)
    kinds = {(st.offloaded, st.host_state) for st in module.storages}  # type: ignore[attr-defined]
    assert (True, True) in kinds and (False, True) in kinds, "offloaded and resident regions"
    for st in module.storages:  # type: ignore[attr-defined]
        assert st.master.dtype == torch.bfloat16 and st.grad.dtype == torch.bfloat16
        assert st.master_is_upload_copy
        if st.offloaded:
            assert st.host_params is st.master
    for p in amp.optimizer.param_groups[0]["params"]:
        entry = amp.optimizer.state[p]
        if state == "bf16_8bit":
            assert entry["exp_avg"].dtype == torch.int8
            assert entry["exp_avg_sq"].dtype == torch.uint8
            assert entry["exp_avg_scale"].dtype == torch.float32
        else:
            assert entry["exp_avg"].dtype == torch.bfloat16
    losses = train_offload(amp, module, range(30))  # type: ignore[arg-type]
    assert fell(losses, 0.3), losses


def test_bf16_masters_take_fewer_host_bytes() -> None:
    module, _ = _module("bf16_stochastic")
    plan = module.plan  # type: ignore[attr-defined]
    fp32 = required_host_bytes(plan, torch.bfloat16)
    bf16 = required_host_bytes(
        plan, torch.bfloat16, host_master_dtype=torch.bfloat16, moment_bytes=2.0
    )
    offloaded = sum(st.numel for st in module.storages if st.offloaded)  # type: ignore[attr-defined]
    resident = sum(st.numel for st in module.storages if not st.offloaded)  # type: ignore[attr-defined]
    # Per parameter: fp32 master + grad + bf16 staging + 2 fp32 moments = 18, and a bf16
    # upload copy where offloaded (20); a bf16 master (its own copy) + bf16 grad + staging
    # + 2 bf16 moments = 10.
    assert fp32 - bf16 == 10 * offloaded + 8 * resident


def test_nearest_rung_steps_as_adamw_on_bf16_weights() -> None:
    """``bf16_nearest``: torch's fused AdamW over a bf16 model (fp32 arithmetic, each
    result rounded to nearest in bf16; what torchao's ``CPUOffloadOptimizer`` runs): the
    same losses and weights, to the kernels' rounding."""
    model = tiny_gpt2().to(torch.bfloat16)
    module, amp = _module("bf16_nearest")
    plain = copy.deepcopy(model)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    ours = train_offload(amp, module, range(6))  # type: ignore[arg-type]
    ref = []
    for step in range(6):
        opt.zero_grad()
        b = batch(step)
        loss = loss_of(plain(**b), b["input_ids"])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        ref.append(loss.item())
    assert ours == pytest.approx(ref, rel=1e-3)
    # The kernels' fp32 arithmetic differs from torch's in rounding only (FMA contraction,
    # operation order): each weight at most one bf16 step (adjacent bit patterns) apart.
    reference = dict(plain.named_parameters())
    for name, p in module.named_parameters():  # type: ignore[attr-defined]
        ours_bits = p.detach().view(torch.int16).int()
        torch_bits = reference[name].detach().view(torch.int16).int()
        assert (ours_bits - torch_bits).abs().max() <= 1, name


def test_stochastic_rounding_keeps_updates_nearest_loses() -> None:
    """An update of a fraction of a bf16 ulp: nearest rounding never moves the weight,
    stochastic rounding moves it in expectation."""
    n = 1 << 14
    hyper_lr = 1e-4  # the Adam update is lr * sign: 1e-4 against a ulp of 2**-7 at 1.0
    from offload_runtime.host_kernels import AdamHyper

    hyper = AdamHyper(lr=hyper_lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    results = {}
    for stochastic in (False, True):
        w = torch.ones(n, dtype=torch.bfloat16)
        m = torch.zeros(n, dtype=torch.bfloat16)
        v = torch.zeros(n, dtype=torch.bfloat16)
        g = torch.full((n,), -1.0, dtype=torch.bfloat16)
        for step in range(1, 21):
            low_precision.reference_adam_bf16_(
                w, g, m, v, torch.tensor(float(step)), hyper, stochastic=stochastic, seed=step
            )
        results[stochastic] = w.float().mean().item()
    assert results[False] == 1.0
    assert results[True] == pytest.approx(1.0 + 20 * hyper_lr, rel=0, abs=4e-4)


@pytest.mark.parametrize("state", BF16_MASTER)
def test_checkpoint_resumes_bit_for_bit(state: str) -> None:
    """Save after 3 steps, load into a fresh module and optimizer, 3 more steps: the same
    losses, masters and moments as 6 steps straight (stochastic rounding draws its bits
    from the step count, which the checkpoint carries)."""
    module, amp = _module(state)
    straight = train_offload(amp, module, range(6))  # type: ignore[arg-type]
    first, amp1 = _module(state)
    part = train_offload(amp1, first, range(3))  # type: ignore[arg-type]
    saved = amp1.state_dict()
    again, amp2 = _module(state)
    amp2.load_state_dict(saved)
    part += train_offload(amp2, again, range(3, 6))  # type: ignore[arg-type]
    assert part == straight
    for (name, p), (_, q) in zip(
        module.named_parameters(),  # type: ignore[attr-defined]
        again.named_parameters(),  # type: ignore[attr-defined]
        strict=True,
    ):
        assert torch.equal(p, q), name
    params = zip(
        amp.optimizer.param_groups[0]["params"],
        amp2.optimizer.param_groups[0]["params"],
        strict=True,
    )
    for p, q in params:
        for key, value in amp.optimizer.state[p].items():
            assert torch.equal(value, amp2.optimizer.state[q][key]), key


def test_eight_bit_rung_loads_floating_moments() -> None:
    """An AdamW-style state dict (fp32 moments) loads into the 8-bit rung quantized, as
    ``quantize_moments_`` makes the codes."""
    module, amp = _module("bf16_8bit")
    train_offload(amp, module, range(2))  # type: ignore[arg-type]
    opt = amp.optimizer
    saved = opt.state_dict()
    gen = torch.Generator().manual_seed(0)
    for entry in saved["state"].values():
        entry.pop("exp_avg_scale")
        entry.pop("exp_avg_sq_scale")
        entry["exp_avg"] = torch.randn(entry["exp_avg"].shape, generator=gen) * 1e-3
        entry["exp_avg_sq"] = torch.rand(entry["exp_avg_sq"].shape, generator=gen) * 1e-6
    opt.load_state_dict(saved)
    index = {id(p): i for i, p in enumerate(opt.param_groups[0]["params"])}
    # Every segment's codes decode to within the quantization's error of what was loaded.
    for rs in opt._layout.regions.values():
        for seg in rs.segments:
            assert seg.scales is not None
            m, v = low_precision.dequantize_moments(
                seg.exp_avg, seg.scales[0], seg.exp_avg_sq, seg.scales[1]
            )
            states = [saved["state"][index[id(p)]] for p in seg.views]
            want_m = torch.cat([e["exp_avg"].reshape(-1) for e in states])
            want_v = torch.cat([e["exp_avg_sq"].reshape(-1) for e in states])
            assert (m - want_m).abs().max() <= 0.02 * want_m.abs().max()
            assert (v - want_v).abs().max() <= 0.05 * want_v.abs().max()


@pytest.mark.parametrize("state", ["bf16_stochastic", "bf16_8bit"])
def test_accumulation_sums_micro_batches_in_the_bf16_accumulator(state: str) -> None:
    """Two micro-batches a step: the second backward adds to the first's gradients (in
    the bf16 accumulator beside a bf16 master), and training falls."""
    config = OffloadConfig(dtype=torch.bfloat16, host_state=state, accumulation_steps=2)
    module = offload_module(
        tiny_gpt2(), batch(0), dtype=torch.bfloat16, all_host_state=True, config=config
    )
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
    losses = train_offload(amp, module, range(20), micro=2)
    assert fell(losses, 0.3), losses
