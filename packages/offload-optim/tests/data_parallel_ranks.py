"""What each rank of ``test_data_parallel.py`` runs: a module the spawned processes import
by name (the test module itself is imported under a path-derived name they cannot)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from optim_helpers import batch, loss_of, masters, tiny_gpt2

from offload_optim import AMPOptimizer, HybridAdam, load_distributed, save_distributed
from offload_runtime import OffloadConfig, OffloadModule, default_cpu_profile, memory_optimize
from offload_solver import InfeasibleBudgetError, ParamPlacement, default_hardware

STEPS = 4
BATCH = 4
SKIPPED: list[bool] = []
"""Whether each step :func:`train` took was skipped (fp16 overflow), in order."""


def _least_budget(model: torch.nn.Module, example: dict[str, torch.Tensor], **kw: Any) -> int:
    """The least budget the planner accepts for ``model`` (it offloads all it can there);
    the same on every rank, planned for a default profile."""
    try:
        _build(model, example, 1, **kw)
    except InfeasibleBudgetError as exc:
        return exc.least_budget_bytes
    raise AssertionError("the planner accepted a 1-byte budget")


def _build(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    budget: int,
    dtype: torch.dtype,
    device: str,
    accumulate: int,
) -> OffloadModule:
    return memory_optimize(
        model,
        example,
        budget,
        config=OffloadConfig(dtype=dtype, accumulation_steps=accumulate),
        # Documented defaults: no rank measures the machine.
        hardware=default_cpu_profile() if device == "cpu" else default_hardware(),
        device=device,
        progress=False,
    )


def train(
    rank: int,
    world: int,
    seed: int = 0,
    budget: int = 0,
    *,
    clip: float = 0.0,
    steps: tuple[int, int] = (0, STEPS),
    save: str = "",
    resume: str = "",
    fail_at: int = -1,
    fp16_overflow_at: int = -1,
    device: str = "cpu",
    plain: bool = False,
    accumulate: int = 1,
) -> dict[str, torch.Tensor]:
    """Train steps ``range(*steps)`` on share ``rank`` of ``world`` of each batch at ``budget``
    bytes (0: the least the planner accepts; -1: 100 times that, where every region
    stays on the device); the final masters. ``clip``: the clipping norm; ``resume``:
    first load this distributed checkpoint; ``save``: save one after the last step;
    ``fail_at``: raise in that step's backward instead; ``fp16_overflow_at``: train in
    fp16, and rank 1's gradients of the first region it does not own overflow in that
    step before they are reduced. Each step's skip decision goes to :data:`SKIPPED`.
    ``device``: where to train (every rank on the one GPU with ``"cuda"``); ``plain``:
    give the optimizer a tensor besides the module's parameters; ``accumulate``: each
    rank's share of the batch in that many micro-batches a step."""
    micro = BATCH // world // accumulate

    def part(step: int, j: int = 0) -> dict[str, torch.Tensor]:
        start = (rank * accumulate + j) * micro
        return {k: v[start : start + micro].to(device) for k, v in batch(step, BATCH).items()}

    model = tiny_gpt2(seed=seed)
    dtype = torch.float16 if fp16_overflow_at >= 0 else torch.float32
    kw = {"dtype": dtype, "device": device, "accumulate": accumulate}
    least = _least_budget(model, part(0), **kw)  # on every rank: it plans collectively
    module = _build(model, part(0), {0: least, -1: 100 * least}.get(budget, budget), **kw)
    if budget == 0:
        assert any(rp.placement is not ParamPlacement.RESIDENT for rp in module.plan.regions)
        # Host state to shard: every rank owns some.
        assert world == 1 or (module.sharding is not None and module.sharding.owned)
    if budget == -1:
        # Device state, its gradients folded in at the end of backward.
        assert module.controller.batched_device_regions
    # The ranks share this machine's host: each planned with its share of it.
    assert ("host shared by" in module.plan.hardware_name) == (world > 1)
    assert module.device.type == device
    # The attention's key bias gets a gradient that is zero up to rounding (softmax ignores
    # a shift shared by all keys), and Adam's normalised step turns zeros rounded another
    # way into steps of up to lr: an eps well above that rounding keeps them small.
    params = [*module.parameters(), *([torch.zeros(3, requires_grad=True)] if plain else [])]
    adam = HybridAdam(params, lr=1e-2, weight_decay=0.01, eps=1e-5)
    amp = AMPOptimizer(adam, module, clipping_norm=clip)
    _check_sharding(module, adam, rank, world)
    if fp16_overflow_at >= 0 and rank == 1:
        _overflow_before_reducing(module, lambda: step == fp16_overflow_at)
    if resume:
        assert load_distributed(amp, resume) == {"done": steps[0]}
    before = masters(module)
    for step in range(*steps):
        amp.zero_grad()
        if step == fail_at:
            raise RuntimeError(f"rank {rank} fails in step {step}")
        for j in range(accumulate):
            b = part(step, j)
            amp.backward(loss_of(module(**b), b["input_ids"]) / accumulate)
        amp.step()
        report = amp.last_step
        assert report is not None
        SKIPPED.append(report.skipped)
        if clip:
            assert report.clip_coef < 1.0  # clipping did clip
    if save:
        save_distributed(amp, save, {"done": steps[1]})
    out = masters(module)
    assert any(not torch.equal(before[name], out[name]) for name in out)
    module.close()
    return out


def _overflow_before_reducing(module: OffloadModule, when: Callable[[], bool]) -> None:
    """An inf in the first region's gradients that another rank steps, whenever
    ``when()``, before they are reduced to that rank."""
    sharding, reduce = module.sharding, module.controller.grad_reducer
    assert sharding is not None and sharding.elsewhere and reduce is not None
    first = min(sharding.elsewhere)

    def poisoned(r: int, grads: list[torch.Tensor]) -> bool:
        if r == first and when():
            with torch.no_grad():
                grads[0].view(-1)[0] = float("inf")
        return reduce(r, grads)

    module.controller.grad_reducer = poisoned


def _check_sharding(module: OffloadModule, adam: HybridAdam, rank: int, world: int) -> None:
    """Each host-state region with trainable parameters has one owner, the only rank
    whose optimizer keeps its state and gradients; every rank keeps every device-state
    region's."""
    sharding = module.sharding
    if world == 1:
        assert sharding is None
        return
    assert sharding is not None and (sharding.rank, sharding.world) == (rank, world)
    for st in module.storages:
        owner = sharding.owners[st.index]
        if st.host_state and st.trainable_numel:
            assert owner is not None and 0 <= owner < world
            assert adam.has_region(st.index) == (owner == rank)
            # A region stepped elsewhere keeps no gradient buffers here.
            assert st.grad.numel() == (st.numel if owner == rank else 0)
        else:
            assert owner is None
            assert adam.has_region(st.index) == bool(st.trainable_numel)


def rank_main(rank: int, world: int, store: str, out: str, options: dict[str, Any]) -> None:
    """One rank of ``train(rank, world, **options)``: its final masters to ``out.RANK``,
    and the sharded regions it owns to ``out.RANK.owned``. Its error goes to
    ``out.RANK.error`` and it returns, or with ``fail_at`` in ``options`` it raises.
    ``options["seed"]`` is rank 1's seed (the others build from 0); ``fail_rank`` plans
    at a 1-byte budget."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    options = dict(options)
    seed = options.pop("seed", 0)
    if options.pop("fail_rank", -1) == rank:
        options["budget"] = 1
    if "fail_at" in options and rank != 1:
        options.pop("fail_at")
    try:
        final = train(rank, world, seed if rank == 1 else 0, **options)
        torch.save(final, f"{out}.{rank}")
        Path(f"{out}.{rank}.skipped").write_text(repr(SKIPPED))
    except Exception as exc:
        if "fail_at" in options:
            raise
        Path(f"{out}.{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def spawn(tmp_path: Path, world: int, **options: Any) -> list[Path]:
    """Run :func:`rank_main` on ``world`` processes, writing under ``tmp_path``; each
    rank's final masters file."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "masters"
    store = tmp_path / "store"
    mp.spawn(rank_main, args=(world, str(store), str(out), options), nprocs=world)
    return [tmp_path / f"masters.{rank}" for rank in range(world)]


def same_everywhere(
    files: list[Path], expected: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Every rank holds the same weights, bit for bit, and they equal ``expected`` up to
    rounding (the ranks sum their shares of the batch in another order)."""
    ranks = [torch.load(f, weights_only=True) for f in files]
    for name, want in expected.items():
        for rank, got in enumerate(ranks):
            assert torch.equal(got[name], ranks[0][name]), (rank, name)
        got, where = ranks[0][name].cpu(), name
        torch.testing.assert_close(
            got, want.cpu(), rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}"
        )
