"""GPU behaviour of the runtime: fp16 equivalence, uploads on the streams the plan says,
peak memory under the budget, pinned host memory, attention rates planned with.

Run with ``nox -s gpu_tests`` on a CUDA machine.
"""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from tiny_models import (
    UPLOAD_STATS,
    forcing_budget,
    gpt2,
    loss_of,
    offloaded_half,
    uploads_per_step,
)

from offload_runtime import (
    OffloadConfig,
    OffloadModule,
    PlanForce,
    memory_optimize,
    profile_hardware,
)
from offload_runtime.planning import build_offload_module, measure_device_bytes_in_use, plan_model
from offload_runtime.storage import alloc_host
from offload_solver import HardwareProfile, ParamPlacement
from offload_solver.solve import BUDGET_SAFETY_FACTOR

pytestmark = pytest.mark.gpu

GiB = 2**30


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("this test is marked gpu: run it on a machine with CUDA")
    # Earlier tests' models and graphs sit in reference cycles (GraphModules, autograd
    # graphs): collect them so that their device memory is not held through this test.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def batch(b: int, s: int, seed: int = 0, *, mask: bool = True) -> dict[str, torch.Tensor]:
    """Random token ids, with an all-ones attention mask unless ``mask`` is False.

    Without a mask the trace rewrites GPT-2's causal mask to ``is_causal=True`` and the
    fused kernels apply; with one, gpt2_xl's head dim of 50 sends attention down the math
    path (O(seq^2) fp32 intermediates), as on CUDA.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1024, (b, s), generator=gen).cuda()
    if not mask:
        return {"input_ids": ids}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def budget_beside(held: int, budget: int) -> int:
    """A budget that leaves a plan the room ``budget`` alone would, beside ``held`` bytes
    this process holds already (earlier tests' tensors). memory_optimize plans against
    ``BUDGET_SAFETY_FACTOR`` (0.95) of the budget and takes what is in use off that, so
    the held bytes are added divided by it."""
    return math.ceil(held / BUDGET_SAFETY_FACTOR) + budget


def train_steps(module: OffloadModule, inp: dict[str, torch.Tensor], steps: int) -> None:
    """Forward + backward ``steps`` times, each waiting for the host's gradient work."""
    for _ in range(steps):
        module.backward(loss_of(module(**inp), inp["input_ids"]))
        module.controller.wait_host()
        module.zero_grad()
    torch.cuda.synchronize()


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_fp16_gradients_match_plain_fp16_training(solver: str) -> None:
    torch.manual_seed(0)
    model = gpt2(256, 6, 4)
    inp = batch(8, 64)
    reference = copy.deepcopy(model).half().cuda()
    loss_of(reference(**inp), inp["input_ids"]).backward()
    hardware = profile_hardware("cuda", progress=False)
    # Traced as memory_optimize traces it by default: GPT-2's GELU fused.
    budget = forcing_budget(model, inp, solver, torch.float16, hardware, fuse_gelu=True)
    planned = plan_model(
        model,
        inp,
        budget,
        solver,
        config=OffloadConfig(),
        hardware=hardware,
        progress=False,
        # The reference model beside it is not the module's: this budget only forces
        # offload, so nothing in use comes off it.
        force=PlanForce(block_search_range_bytes=0, device_bytes_in_use=0),
    )
    module = build_offload_module(model, planned)
    assert offloaded_half(module.plan, solver)
    before = dict(module.controller.stats)
    logits = module(**inp)
    module.backward(loss_of(logits, inp["input_ids"]))
    # Each upload ran as the plan says: async regions prefetched on the H2D stream in
    # forward and backward, each into its pool block, none left to an upload at use.
    stats = module.controller.stats
    assert {k: stats[k] - before[k] for k in UPLOAD_STATS} == uploads_per_step(module.plan)
    assert torch.allclose(logits.float(), reference(**inp).float(), atol=2e-2, rtol=2e-2)
    grads = dict(module.named_gradients())
    for name, p in reference.named_parameters():
        assert p.grad is not None
        # Host-state gradients live on the host: compare on the CPU.
        err = float((grads[name].float().cpu() - p.grad.float().cpu()).abs().max())
        scale = float(p.grad.float().abs().max()) + 1e-6
        assert err <= 2e-2 * scale, (name, err, scale)


def test_bytes_in_use_hold_the_workspaces_a_training_step_allocates() -> None:
    # After the measurement, a forward and backward allocate nothing that stays: the
    # libraries' workspaces were already counted. The model's own weights on the device
    # are not counted (the module copies them), the caller's other tensors are.
    dev = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Linear(512, 512).half().to(dev)
    other = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
    in_use = measure_device_bytes_in_use(dev, model, torch.float16)
    held = torch.cuda.memory_allocated(dev)
    weights = sum(t.untyped_storage().nbytes() for t in model.parameters())
    assert in_use == held - weights
    assert in_use >= other.untyped_storage().nbytes()
    x = torch.randn(256, 512, device=dev, dtype=torch.float16, requires_grad=True)
    model(x).float().sum().backward()
    del x
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize(dev)
    assert torch.cuda.memory_allocated(dev) == held


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_measured_peak_stays_within_budget(solver: str) -> None:
    torch.manual_seed(0)
    model = gpt2(1024, 24, 16)  # gpt2_medium shape
    inp = batch(64, 8)
    # Parameters alone are 0.7 GiB fp16, optimizer state 4.9 GiB. With GPT-2's GELU fused
    # (memory_optimize's default) 1.0 GiB makes both solvers offload regions (the test
    # checks that they do: at 1.25 GiB the sync solver keeps every region resident).
    # The budget caps everything allocated on the device while training, so whatever this
    # process still holds (``base``) is added to it; memory_optimize measures what is in use
    # (that, the inputs and the BLAS workspaces) and plans the module in the rest.
    base = torch.cuda.memory_allocated()
    budget = budget_beside(base, int(1.0 * GiB))
    module = memory_optimize(model, inp, budget, solver, progress=False)
    assert any(rp.placement is not ParamPlacement.RESIDENT for rp in module.plan.regions)
    # Training is what the budget is for: hardware profiling inside memory_optimize uses
    # large scratch buffers once (and frees them), so the peak is counted from here; the
    # module's own buffers are still allocated, so they count.
    torch.cuda.reset_peak_memory_stats()
    train_steps(module, inp, 3)
    peak = torch.cuda.max_memory_allocated()
    print(
        f"{solver}: {base / 2**20:.1f} MiB held before, measured peak {peak / 2**20:.1f} MiB, "
        f"predicted {module.plan.predicted_peak_bytes / 2**20:.1f} MiB, "
        f"budget {budget / 2**20:.0f} MiB"
    )
    assert peak <= budget


def _host_allocator_bytes() -> int | None:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    return int(stats().get("allocated_bytes.current", 0))


def test_host_buffers_are_pinned_at_their_exact_size() -> None:
    """Region buffers are page-locked in place, not taken from PyTorch's caching host
    allocator, which rounds each allocation up to a power of two (see [Note: exact-size
    pinned memory] in storage.py)."""
    numel = (3 << 20) + 5  # 12 MiB + 20 bytes: the caching allocator would take 16 MiB
    before = _host_allocator_bytes()
    buf = alloc_host(numel, torch.float32, pin=True)
    assert buf.is_pinned()
    if before is not None:
        assert _host_allocator_bytes() == before
    buf.copy_(torch.arange(numel, dtype=torch.float32))
    on_device = buf[1:].to("cuda", non_blocking=True)
    back = torch.empty_like(buf[1:])
    back.copy_(on_device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, buf[1:])
    view = buf[7:]
    del buf
    gc.collect()
    assert view.is_pinned()  # the view keeps the registered base alive
    del view, back, on_device
    gc.collect()


def test_attention_rates_are_measured_at_the_zoo_gpt2_xl_shape() -> None:
    """``measure_attention_flop_per_s`` at the zoo GPT-2 XL's attention (8 x 32 heads x
    1024 x 50, fp16, causal, dropout 0.1: the flash kernel pads the head dim) runs on the
    device and returns a finite positive rate each way (how fast is the machine's, not
    the test's)."""
    from offload_runtime.hardware import measure_attention_flop_per_s

    fwd, bwd = measure_attention_flop_per_s(
        "cuda", batch=8, heads=32, seq=1024, head_dim=50, dropout_p=0.1
    )
    assert 0 < fwd < math.inf
    assert 0 < bwd < math.inf


def test_measure_attention_plans_with_the_models_own_attention_rates() -> None:
    """``PlanForce(measure_attention=True)`` on two layers of the zoo's GPT-2 XL
    (32 heads of 50) at 8 x 1024 tokens (causal, no mask: the fused kernels) plans with
    attention rates measured on this GPU (the profile the module was planned with carries
    them); without it the rates stay unset (the matmul rate). The default (None) measures
    them on the GPU (here: reads them from the cache), and a profile that carries them is
    planned with them as given."""
    model = gpt2(1600, 2, 32)
    inp = batch(8, 1024, mask=False)

    def planned(measure: bool | None, hardware: HardwareProfile | None = None) -> OffloadModule:
        planned = plan_model(
            model,
            inp,
            8 * GiB,
            "asyn",
            hardware=hardware,
            progress=False,
            force=PlanForce(measure_attention=measure),
        )
        return build_offload_module(model, planned)

    plain = planned(False)
    assert plain.hardware is not None and plain.hardware.attention_fwd_flop_per_s == 0.0
    measured = planned(True)
    hw = measured.hardware
    assert hw is not None
    assert 0 < hw.attention_fwd_flop_per_s < math.inf
    assert 0 < hw.attention_bwd_flop_per_s < math.inf
    by_default = planned(None)
    assert by_default.hardware is not None and by_default.hardware.attention_fwd_flop_per_s > 0
    # Measured once per model shape and cached with the matrix shapes' profile: the
    # default reads the rates the forced measurement stored, not a new timing.
    assert by_default.hardware.attention_fwd_flop_per_s == hw.attention_fwd_flop_per_s
    again = planned(None, hw)
    assert again.hardware is not None
    assert again.hardware.attention_fwd_flop_per_s == hw.attention_fwd_flop_per_s
    assert again.hardware.attention_bwd_flop_per_s == hw.attention_bwd_flop_per_s
    for module in (plain, measured, by_default, again):
        module.close()
