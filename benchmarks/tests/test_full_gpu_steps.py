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
    ("amp", "scaler", "dtype"),
    [(False, "1", torch.float16), (False, "0", torch.float16), (True, "0", torch.float32)],
    ids=["fp16_scaled", "fp16_unscaled", "amp"],
)
def test_each_recipe_trains_its_own_dtype_and_scales_as_told(
    tiny: str, monkeypatch: pytest.MonkeyPatch, amp: bool, scaler: str, dtype: torch.dtype
) -> None:
    monkeypatch.setenv("BENCH_FULL_GPU_SCALER", scaler)
    torch.manual_seed(0)
    full = offload_bench._full_gpu_steps(tiny, amp, device="cpu")
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
