"""bf16 Adam moments for host-resident state: exact route, and its effect on training."""

from __future__ import annotations

import math

import pytest
import torch
from optim_helpers import batch, fell, offload_module, tiny_gpt2, train_offload

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig
from offload_runtime.host_kernels import CHUNK_NUMEL, AdamHyper, fused_adam_, single_pass

STEP_TOLERANCE = 0.03
"""Largest relative difference of one step's loss, bf16 against fp32 moments, over 50
steps at lr 1e-2 on the tiny GPT-2 (measured on the CPU: 0.013)."""
TAIL_TOLERANCE = 0.01
"""Relative difference of the mean loss of the last 10 steps (measured: 0.003)."""


def test_chunked_route_is_fp32_adam_on_the_stored_moments() -> None:
    """Each step equals: widen the bf16 moments, fused fp32 Adam, round back to bf16."""
    n = CHUNK_NUMEL + 1000  # two chunks, the second one partial
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(n, generator=gen)
    m16 = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
    v16 = (torch.rand(n, generator=gen) * 1e-4).bfloat16()
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)
    ref_p, ref_m, ref_v = param.clone(), m16.float(), v16.float()
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen)
        steps = [torch.tensor(float(step))]
        fused_adam_([param], [grad.clone()], [m16], [v16], steps, hyper, torch.tensor(2.0))
        fused_adam_([ref_p], [grad.clone()], [ref_m], [ref_v], steps, hyper, torch.tensor(2.0))
        ref_m, ref_v = ref_m.bfloat16().float(), ref_v.bfloat16().float()
        assert torch.equal(param, ref_p)
        assert torch.equal(m16.float(), ref_m) and torch.equal(v16.float(), ref_v)


def test_bf16_moments_live_only_in_host_state() -> None:
    config = OffloadConfig(dtype=torch.float32, host_state="bf16_moments")
    module = offload_module(tiny_gpt2(), batch(0), config=config)
    opt = HybridAdam(module.parameters())
    opt.bind(module)
    assert opt.moments_dtype == torch.bfloat16, "the module's configuration"
    for name, p in module.named_parameters():
        st = next(s for s in module.storages if name in s.master_views)
        want = torch.bfloat16 if st.host_state else torch.float32
        assert opt.state[p]["exp_avg"].dtype == want, name
        assert opt.state[p]["exp_avg_sq"].dtype == want, name


def test_bf16_moments_train_close_to_fp32_moments() -> None:
    curves = {}
    for dtype in (torch.float32, torch.bfloat16):
        config = OffloadConfig(
            dtype=torch.float32, host_state="fp32" if dtype == torch.float32 else "bf16_moments"
        )
        module = offload_module(tiny_gpt2(), batch(0), all_host_state=True, config=config)
        opt = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01)
        curves[dtype] = train_offload(AMPOptimizer(opt, module), module, range(50))
    fp32, bf16 = curves[torch.float32], curves[torch.bfloat16]
    assert fell(bf16, 0.3), "bf16 moments must train"
    worst = max(abs(a - b) / b for a, b in zip(bf16, fp32, strict=True))
    assert worst < STEP_TOLERANCE, worst
    tail = abs(sum(bf16[-10:]) - sum(fp32[-10:])) / sum(fp32[-10:])
    assert tail < TAIL_TOLERANCE, tail
    assert bf16 != fp32, "the option must actually change the moments' precision"


@pytest.mark.skipif(not single_pass.available(), reason="numba missing")
def test_single_pass_kernels_round_bf16_moments_as_torch_does() -> None:
    """The single-pass kernels narrow the new moments in their loop with integer
    operations: the bits must be torch's ``.bfloat16()`` (round to nearest even) at every
    rounding case, and a NaN stays a NaN. With zero moments, beta1 = beta2 = 0 and no decay, the
    new moments are exactly the gradient and its square in fp32."""
    from offload_runtime.host_kernels._numba_adam import BLOCK  # imports numba

    ulp_ends = torch.arange(-(2**15), 2**15, 997, dtype=torch.int32).to(torch.int16)
    grid = ulp_ends.view(torch.bfloat16).float()
    grid = grid[grid.isfinite() & (grid != 0)]
    half_ulp = (grid.view(torch.int32) + (1 << 15)).view(torch.float32)  # ties
    probes = torch.cat(
        [
            grid,
            half_ulp,
            torch.nextafter(half_ulp, torch.tensor(math.inf)),
            torch.nextafter(half_ulp, torch.tensor(-math.inf)),
            torch.tensor([1e-40, -1e-40, 3.4e38, math.inf, -math.inf, math.nan, 1.0, 0.0]),
        ]
    )
    n = BLOCK + probes.numel()  # a second block with a ragged tail
    g = torch.cat([torch.randn(BLOCK, generator=torch.Generator().manual_seed(0)), probes])
    hyper = AdamHyper(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw=True)
    step = torch.tensor(1.0)
    want_m, want_v = g.bfloat16(), (g * g).bfloat16()
    zeros = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(2)]
    single_pass.adam_(torch.zeros(n), g.clone(), *zeros, step, hyper)
    nm, nv = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    single_pass.speculative_adam_(
        torch.zeros(n), g.clone(), *[torch.zeros(n, dtype=torch.bfloat16)] * 2, nm, nv,
        torch.empty(n), step, hyper,
    )  # fmt: skip
    for got, want in ((zeros[0], want_m), (zeros[1], want_v), (nm, want_m), (nv, want_v)):
        # A NaN's bits differ between torch's scalar (0x7FC0) and vector (0xFFFF) paths.
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan) and bool(nan.any())
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
