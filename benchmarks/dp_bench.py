"""Data-parallel benchmark: ours and FSDP2's CPU offload on the GPUs of one host.

One row a launch, under ``torchrun`` (one process a GPU, NCCL), with the packages' ``src``
folders on ``PYTHONPATH``:

    torchrun --standalone --nproc_per_node=N benchmarks/dp_bench.py --workload W3 \\
        --kind ours --out dp_out
    python benchmarks/dp_bench.py --table dp_out          # the report's table

for N in 1, 2, 4 and each of W3 and W5 (:data:`offload_bench.WORKLOADS`; the batch and
budget are each rank's, so N ranks train N times the batch) and kinds ``ours``
(``memory_optimize`` as a user calls it under ``torch.distributed``: host optimizer state
sharded by region) and ``fsdp2`` (``fully_shard`` over the N GPUs with
``CPUOffloadPolicy``, as ``offload_bench.py``'s world-size-1 row but sharded over the
ranks). ``--device cpu`` runs ours over gloo on the CPU (tests, with the tiny workload
``T``).

Rank 0 writes ``OUT/<workload>_<kind>_x<N>.json``: the run's date, commit, GPU, torch and
command, and each rank's step time (the mean of its 5 fastest timed steps, and the run
mean) and peak device memory. A row's step time is its slowest rank's, its throughput
``N * batch`` sequences over that. ``--table`` prints, per workload and world size, each
kind's step and throughput, the scaling efficiency (throughput on N GPUs over N times the
same kind's on one) and ours over FSDP2's step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offload_bench import (
    OURS,
    WORKLOADS,
    GiB,
    _build_ours,
    _memory,
    _reset_peak,
    _timed_steps,
    fsdp2_step,
    machine,
    run_meta,
    step_times,
    workload_batch,
)

KINDS = ("ours", "fsdp2")
TINY = ("gpt2_tiny", 4, 16, 0.004)
"""The workload ``T`` (gpt2_tiny, 4 x 16 tokens a rank, 4 MiB: host-state regions to
shard), for CPU runs of this script."""


def _rank_step(
    workload: str, kind: str, device: str, rank: int, reports: int
) -> tuple[Callable[[], None], Callable[[], bool] | None, list[int] | None]:
    """This rank's training step of ``kind`` at ``workload`` (its batch drawn from seed
    ``rank``, the weights from seed 0 on every rank); for ours, whether the last step was
    skipped (fp16 overflow) and the regions this rank owns."""
    import torch

    from offload_gpt_example.models import WithLMLoss, build_model

    name, _, seq, budget_gib = WORKLOADS[workload]
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        torch.manual_seed(0)
        return fsdp2_step(workload, init_device_mesh("cuda", (world,))), None, None
    torch.manual_seed(rank)
    data = workload_batch(workload, device)
    torch.manual_seed(0)
    cuda = device == "cuda"
    model = build_model(
        name, device="cpu", dtype=torch.float16, seq_len=seq, init_device=device if cuda else None
    )
    module, opt = _build_ours(WithLMLoss(model), data, int(budget_gib * GiB), OURS["ours"], reports)

    def step() -> None:
        opt.backward(module(**data))
        opt.step()
        opt.zero_grad()

    counted = [opt.step_count]

    def skipped() -> bool:
        now, counted[0] = opt.step_count == counted[0], opt.step_count
        return bool(now)

    return step, skipped, None if module.sharding is None else module.sharding.owned


def measure(workload: str, kind: str, device: str, warmup: int, steps: int) -> dict[str, Any]:
    """One row, on every rank of the default process group; the full row on rank 0."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    step, skipped, owned = _rank_step(workload, kind, device, rank, warmup + 3 * steps)
    setup_s = time.perf_counter() - t0
    _reset_peak(device)
    mine: dict[str, Any] = step_times(_timed_steps(step, warmup, steps, device, skipped))
    mine.update(_memory(device))
    mine["owned_regions"] = owned
    ranks: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(ranks, mine)
    batch = WORKLOADS[workload][1]
    slowest = max(float(r["step_ms"]) for r in ranks if r is not None)
    return {
        "workload": workload,
        "kind": kind,
        "world": world,
        "step_ms": slowest,
        "samples_per_s": world * batch / (slowest / 1e3),
        "peak_alloc_gib": max(float(r["peak_alloc_gib"]) for r in ranks if r is not None),
        "setup_s": setup_s,
        "ranks": ranks,
    }


def row_name(workload: str, kind: str, world: int) -> str:
    return f"{workload}_{kind}_x{world}.json"


def table(folder: Path) -> str:
    """The report's table over the rows in ``folder`` (markdown)."""
    rows = [json.loads(p.read_text()) for p in sorted(folder.glob("*_x*.json"))]
    by = {(r["workload"], r["kind"], r["world"]): r for r in rows}
    lines = [
        "| workload | GPUs | kind | step ms (slowest rank) | peak GiB | sequences/s | "
        "scaling efficiency | / FSDP2 step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, kind, world in sorted(by):
        r = by[(workload, kind, world)]
        one = by.get((workload, kind, 1))
        eff = "" if one is None else f"{r['samples_per_s'] / (world * one['samples_per_s']):.2f}"
        peer = by.get((workload, "fsdp2", world))
        ratio = "" if peer is None or kind == "fsdp2" else f"{r['step_ms'] / peer['step_ms']:.3f}x"
        lines.append(
            f"| {workload} | {world} | {kind} | {r['step_ms']:.1f} | {r['peak_alloc_gib']:.2f} "
            f"| {r['samples_per_s']:.2f} | {eff} | {ratio} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="W3", help="a workload of offload_bench.py, or T")
    p.add_argument("--kind", choices=KINDS, default="ours")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("dp_out"))
    p.add_argument("--table", type=Path, default=None, metavar="DIR", help="print the table")
    args = p.parse_args(argv)
    if args.workload == "T":
        WORKLOADS["T"] = TINY
    if args.workload not in WORKLOADS:
        p.error(f"--workload {args.workload}: one of {sorted(WORKLOADS)} or T")
    if args.kind == "fsdp2" and args.device != "cuda":
        p.error("--kind fsdp2 needs --device cuda (CPUOffloadPolicy offloads from a GPU)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table is not None:
        print(table(args.table))
        return 0
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        row = measure(args.workload, args.kind, args.device, args.warmup, args.steps)
        if dist.get_rank() == 0:
            row.update(run_meta([]))
            launched = " ".join(sys.argv[1:] if argv is None else argv)
            row["command"] = (
                f"torchrun --standalone --nproc_per_node={row['world']} "
                f"benchmarks/dp_bench.py {launched}"
            )
            row.update(machine())
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / row_name(args.workload, args.kind, row["world"])
            path.write_text(json.dumps(row, indent=1) + "\n")
            print(f"[dp_bench] {path.name}: {row['step_ms']:.1f} ms", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
