"""offload_bench._full_gpu_steps, the full-GPU peer's training, on the CPU with the zoo's
tiny GPT-2: fp16 weights and state (loss scaled or not) and torch's mixed-precision recipe."""

from __future__ import annotations

from collections.abc import Iterator

import offload_bench
import pytest
import torch


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setitem(offload_bench.WORKLOADS, "T", ("gpt2_tiny", 2, 16, 1))
    yield "T"


@pytest.mark.parametrize(
    ("recipe", "scaler", "dtype"),
    [
        ("fp16", "1", torch.float16),
        ("fp16", "0", torch.float16),
        ("amp", "0", torch.float32),
        ("master", "0", torch.float16),
    ],
    ids=["fp16_scaled", "fp16_unscaled", "amp", "master"],
)
def test_each_recipe_trains_its_own_dtype_and_scales_as_told(
    tiny: str, monkeypatch: pytest.MonkeyPatch, recipe: str, scaler: str, dtype: torch.dtype
) -> None:
    monkeypatch.setenv("BENCH_FULL_GPU_SCALER", scaler)
    torch.manual_seed(0)
    full = offload_bench._full_gpu_steps(tiny, recipe, device="cpu")
    amp = recipe != "fp16"  # scaled whatever BENCH_FULL_GPU_SCALER says
    step, fwd_bwd, zero = full.step, full.fwd_bwd, full.zero
    params = full.parameters()
    assert full.loss_scale() == (65536.0 if amp or scaler == "1" else None)
    assert 6.0 < full.loss() < 8.0  # about log(1024) at initialisation
    assert {p.dtype for p in params} == {dtype}
    before = [p.detach().clone() for p in params]
    fwd_bwd()
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and {g.dtype for g in grads} == {dtype}
    # Scaled (amp always is), the gradients are 2**16 times the loss's: far above 1e-3.
    largest = max(float(g.abs().max()) for g in grads)
    assert (largest > 1.0) == (amp or scaler == "1")
    zero()
    assert all(p.grad is None for p in params)
    for _ in range(2):
        step()
    assert any(not torch.equal(p.detach(), b) for p, b in zip(params, before, strict=True))


def test_master_steps_fp32_copies_and_narrows_them_into_the_weights(tiny: str) -> None:
    torch.manual_seed(0)
    full = offload_bench._full_gpu_steps(tiny, "master", device="cpu")
    params = full.parameters()
    masters = full.optimizer.param_groups[0]["params"]
    assert len(masters) == len(params) and {m.dtype for m in masters} == {torch.float32}
    # The masters start as the weights widened.
    assert all(
        torch.equal(m.detach(), p.detach().float()) for m, p in zip(masters, params, strict=True)
    )
    # One step by hand: the scaled fp16 gradients, widened and unscaled, through plain
    # (unfused) fp32 Adam on copies of the masters, must give the recipe's masters.
    ref = [m.detach().clone().requires_grad_(True) for m in masters]
    ref_opt = torch.optim.Adam(ref, lr=1e-4)
    torch.manual_seed(1)  # the model's dropout: the same masks in both passes
    full.fwd_bwd()
    scale = full.loss_scale()
    assert scale == 65536.0
    for r, p in zip(ref, params, strict=True):
        assert p.grad is not None
        r.grad = p.grad.float() / scale
    ref_opt.step()
    full.zero()
    torch.manual_seed(1)
    full.step()  # the same forward at the same weights, so the same gradients
    for m, r, p in zip(masters, ref, params, strict=True):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), m.detach().half())  # narrowed into the weights
    state = full.optimizer.state[masters[0]]
    assert state["exp_avg_sq"].dtype == torch.float32
    assert float((state["exp_avg_sq"] == 0).float().mean()) < 0.5


def test_unknown_recipes_are_refused(tiny: str) -> None:
    with pytest.raises(ValueError, match="recipe 'bf16'"):
        offload_bench._full_gpu_steps(tiny, "bf16", device="cpu")
