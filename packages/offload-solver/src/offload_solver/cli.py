"""``offload-solve``: plan a profile from the command line.

    offload-solve PROFILE.json --budget 16GiB [--solver asyn] [--hardware HW.json]
                  [--cost-model COST.json] [-o PLAN.json]
                  [--block-search-range 128MiB] [--in-use 64MiB] [--micro-batches K]
                  [--host-step-after-backward | --speculative-step-cost X
                   [--speculative-params N] [--speculation-thread]]
                  [--streamed UP,DOWN,SLOT [--streamed-staged CHUNKS,NUMEL,BYTES]]
    python -m offload_solver PROFILE.json --budget 16GiB

Prints one line per region (operations, MiB, placement, optimizer state: ``device``,
``host`` or ``streamed``, backward prefetch host) and the predicted peak and step time.
Bad input prints a message and exits with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from offload_solver._json import parse_bytes, write_atomic
from offload_solver.cost_model import CostModel
from offload_solver.hardware import HardwareProfile, default_hardware
from offload_solver.plan import ActivationPlacement, Plan, StatePlacement, StreamedStepCosts
from offload_solver.profile import ModelProfile
from offload_solver.regions import BLOCK_SEARCH_RANGE_BYTES
from offload_solver.solve import BUDGET_SAFETY_FACTOR, InfeasibleBudgetError, solve
from offload_solver.solvers import SOLVERS

MiB = 2**20
GiB = 2**30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-solve",
        description="Plan parameter offload for one training step under a device memory budget.",
    )
    p.add_argument("profile", type=Path, help="ModelProfile JSON (e.g. from offload-trace)")
    p.add_argument("--budget", required=True, help="device memory budget, e.g. 16GiB, 16GB, 512MiB")
    p.add_argument("--solver", default="asyn", help=f"one of {', '.join(sorted(SOLVERS))}")
    p.add_argument(
        "--hardware",
        type=Path,
        help="HardwareProfile JSON (default: a PCIe Gen5 H200-like machine)",
    )
    p.add_argument(
        "--cost-model",
        type=Path,
        help="CostModel JSON: the simulator's fitted factors (default: CostModel(), the "
        "fitted defaults); factors it leaves out take their defaults",
    )
    p.add_argument(
        "--block-search-range",
        default=None,
        help="how far above the largest region the pool block-size search looks "
        "(default 128MiB, the reference's; 0 keeps small models' regions apart)",
    )
    p.add_argument(
        "--in-use",
        default="0",
        help="device memory that stays allocated beside the plan's, measured by the caller "
        "(libraries' workspaces, inputs), e.g. 64MiB; it comes off the budget (default 0)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="forward and backward passes per optimizer step (gradient accumulation; "
        "default 1): the predicted step covers them all",
    )
    p.add_argument(
        "--host-step-after-backward",
        action="store_true",
        help="no host optimizer step starts before backward ends (an optimizer that needs a "
        "global answer first, e.g. fp16's overflow check); default: each region steps as "
        "its gradients land",
    )
    p.add_argument(
        "--speculative-step-cost",
        type=float,
        default=1.0,
        help="how many times a plain host step one taken under backward costs (an fp16 "
        "optimizer that speculates and keeps undo data; default 1)",
    )
    p.add_argument(
        "--speculative-params",
        type=int,
        default=None,
        help="how many host-state parameters may step under backward, the regions whose "
        "gradients land first (undo buffers for the rest do not fit; default: all)",
    )
    p.add_argument(
        "--speculation-thread",
        action="store_true",
        help="the steps taken under backward run on a thread of their own, so that "
        "step() does not wait for them (offload_optim's fp16 speculation by default)",
    )
    p.add_argument(
        "--streamed",
        default=None,
        metavar="UP,DOWN,SLOT[,RESIDENT_DOWN]",
        help="let host-state regions that do not step speculatively be stepped on the "
        "device instead (state 'streamed') where that shortens the step: bytes per "
        "parameter copied up and down for such a step and the device ring's size, e.g. "
        "10,10,2GiB; RESIDENT_DOWN: the device step writes a resident region's "
        "parameters on the device and copies this many bytes per parameter down, e.g. "
        "10,10,2GiB,8 (default: none streamed)",
    )
    p.add_argument(
        "--streamed-staged",
        default=None,
        metavar="CHUNKS,NUMEL,BYTES",
        help="with --streamed: the first streamed gradient hook in the backward sends up "
        "the state of the streamed regions' leading CHUNKS chunks of NUMEL parameters, "
        "BYTES bytes per parameter (master weights and moments), and the step the rest; "
        "e.g. 3,16777216,12 (a runtime that stages state in the backward, as "
        "offload_runtime's planner plans by default; default here: none staged)",
    )
    p.add_argument(
        "--no-late-host-work",
        dest="late_host_work",
        action="store_false",
        help="keep the greedy phases' placements: do not move host-state regions to later "
        "regions where the simulated step gets shorter (solve(late_host_work=False))",
    )
    p.add_argument(
        "--activations",
        action="store_true",
        help="where keeping every activation on the device does not fit, also choose "
        "regions whose activations are recomputed before their backward or sent to the "
        "host and back (solve(activations=True))",
    )
    p.add_argument("-o", "--output", type=Path, help="write the plan JSON here")
    return p


def parse_streamed(text: str) -> StreamedStepCosts:
    """``UP,DOWN,SLOT[,RESIDENT_DOWN]`` (bytes per parameter up and down, the ring's size,
    and optionally the bytes per parameter down when the device step writes a resident
    region's parameters on the device, e.g. ``10,10,2GiB`` or ``10,10,2GiB,8``) as
    :class:`StreamedStepCosts`; ``ValueError`` naming the format."""
    parts = [x.strip() for x in text.split(",")]
    if len(parts) not in (3, 4):
        raise ValueError(
            f"--streamed {text!r}: write UP,DOWN,SLOT[,RESIDENT_DOWN], the bytes per "
            "parameter copied up and down, the device ring's size and optionally the "
            "bytes down of a resident region written on the device, e.g. 10,10,2GiB"
        )
    try:
        up, down = float(parts[0]), float(parts[1])
        resident = float(parts[3]) if len(parts) == 4 else None
    except ValueError:
        raise ValueError(
            f"--streamed {text!r}: UP, DOWN and RESIDENT_DOWN must be numbers of bytes "
            "per parameter"
        ) from None
    return StreamedStepCosts(up, down, parse_bytes(parts[2]), resident)


def parse_staged(text: str, costs: StreamedStepCosts) -> StreamedStepCosts:
    """``CHUNKS,NUMEL,BYTES`` (chunks staged in the backward, parameters a chunk, bytes a
    parameter sent up then) on top of ``costs``; ``ValueError`` naming the format."""
    parts = [x.strip() for x in text.split(",")]
    try:
        if len(parts) != 3:
            raise ValueError
        chunks, numel, nbytes = int(parts[0]), int(parts[1]), float(parts[2])
    except ValueError:
        raise ValueError(
            f"--streamed-staged {text!r}: write CHUNKS,NUMEL,BYTES, the chunks whose state "
            "goes up in the backward, parameters a chunk (ints) and bytes a parameter, "
            "e.g. 3,16777216,12"
        ) from None
    return dataclasses.replace(
        costs, staged_chunks=chunks, staged_chunk_numel=numel, staged_bytes_per_param=nbytes
    )


def _streamed_costs(streamed: str | None, staged: str | None) -> StreamedStepCosts | None:
    """The ``--streamed`` and ``--streamed-staged`` arguments as costs (None: none)."""
    if streamed is None:
        if staged is not None:
            raise ValueError("--streamed-staged needs --streamed: it stages streamed regions")
        return None
    costs = parse_streamed(streamed)
    return costs if staged is None else parse_staged(staged, costs)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {str(path)!r}: {exc.strerror}") from None


def format_plan(plan: Plan) -> str:
    """A short table of the plan's regions and its predictions."""
    # The state column is as wide as its longest value ("streamed" only when present).
    sw = max([6] + [len(rp.state.value) for rp in plan.regions])
    lines = [
        f"{'region':>6} {'ops':>13} {'MiB':>10} {'placement':>9} {'state':>{sw}} "
        f"{'prefetch_at':>11}"
    ]
    for rp in plan.regions:
        reg = rp.region
        ops = f"{reg.op_start}-{reg.op_end - 1}"
        pf = "" if rp.prefetch_at is None else str(rp.prefetch_at)
        pin = "*" if reg.pinned else ""
        lines.append(
            f"{reg.index:>6} {ops:>13} {reg.size_bytes / MiB:>10.2f} "
            f"{rp.placement.value + pin:>9} {rp.state.value:>{sw}} {pf:>11}"
        )
    n_off = sum(rp.placement.value != "resident" for rp in plan.regions)
    n_streamed = sum(rp.state is StatePlacement.STREAMED for rp in plan.regions)
    streamed = f", {n_streamed} streamed" if n_streamed else ""
    for mode in (
        ActivationPlacement.RECOMPUTE,
        ActivationPlacement.RECOMPUTE_WITH_PREVIOUS,
        ActivationPlacement.HOST,
    ):
        n_act = sum(rp.activations is mode for rp in plan.regions)
        if n_act:  # shown only where some region does not keep its activations
            streamed += f", {n_act} activations {mode.value}"
    lines.append("(* pinned: owns a parameter used outside its operations)")
    lines.append(
        f"solver {plan.solver}: {n_off}/{len(plan.regions)} regions offloaded{streamed}; "
        f"predicted peak {plan.predicted_peak_bytes / GiB:.3f} GiB of "
        f"{plan.budget_bytes * BUDGET_SAFETY_FACTOR / GiB:.3f} GiB planned "
        f"({BUDGET_SAFETY_FACTOR} x budget {plan.budget_bytes / GiB:.3f} GiB), "
        f"pool {plan.pool_size_bytes / MiB:.1f} MiB; "
        f"predicted step {plan.predicted_step_time_s * 1e3:.2f} ms; "
        f"solved in {plan.solve_time_s:.3f} s with {plan.num_simulations} simulations"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 bad input or no feasible plan)."""
    args = _parser().parse_args(argv)
    try:
        budget = parse_bytes(args.budget)
        profile = ModelProfile.from_json(_read(args.profile, "profile"))
        if args.hardware is not None:
            hardware = HardwareProfile.from_json(_read(args.hardware, "hardware"))
        else:
            hardware = default_hardware()
        cost_model = (
            None
            if args.cost_model is None
            else CostModel.from_json(_read(args.cost_model, "cost model"))
        )
        search_range = (
            BLOCK_SEARCH_RANGE_BYTES
            if args.block_search_range is None
            else parse_bytes(args.block_search_range)
        )
        plan = solve(
            profile,
            hardware,
            budget,
            solver=args.solver,
            block_search_range_bytes=search_range,
            device_bytes_in_use=parse_bytes(args.in_use),
            micro_batches=args.micro_batches,
            host_step_after_backward=args.host_step_after_backward,
            speculative_step_cost=args.speculative_step_cost,
            speculative_params=args.speculative_params,
            speculation_thread=args.speculation_thread,
            streamed=_streamed_costs(args.streamed, args.streamed_staged),
            late_host_work=args.late_host_work,
            cost_model=cost_model,
            activations=args.activations,
        )
        if args.output is not None:
            try:
                write_atomic(args.output, plan.to_json())
            except OSError as exc:
                raise ValueError(
                    f"cannot write plan file {str(args.output)!r}: {exc.strerror}"
                ) from None
    except InfeasibleBudgetError as exc:
        print(f"offload-solve: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"offload-solve: error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.output is not None:
        print(f"plan written to {args.output}")
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through __main__.py
    sys.exit(main())
