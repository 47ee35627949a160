"""Replay measured benchmark rows through this tree's planner and simulator (no GPU).

    python benchmarks/replay_bench.py bench_out
    python benchmarks/replay_bench.py bench_out --backward-issue-factor 3.5
    python benchmarks/replay_bench.py bench_out --stream-up-fraction 0.7 --hold-plan

For each row of ours that recorded the hardware profile its plan was made with (the row
files of ``offload_bench.py --out`` folders, or older ``offload_bench.py --json`` files of
many rows), this traces the workload on the meta device, plans it again with that profile
and the row's own inputs (its configuration, the device memory it found in use, its
speculation limit and cost, its streamed ring, where its dtype conversions ran), and
prints the measured step (the mean of the 5 fastest timed steps, and the run mean) and
peak beside what the row's plan predicted and what this tree predicts. Under a row, the
host's wall time in its ``backward(loss)`` beside the replayed backward's span, and the
backward issue factor at which issuing the plan's operations takes that time
(:func:`backward_issue_factor`). The last lines count the rows whose replayed step
is within 15% of their run mean, in all and by workload.

Fitting the cost model's factors (``offload_solver.CostModel``'s defaults of
``backward_issue_factor``, ``stream_up_fraction`` and ``stream_host_charge``): replay every
row on record at candidate values (``--backward-issue-factor``, ``--stream-up-fraction``,
``--stream-host-charge``) and keep the value under which the most rows predict their run
mean within 15%; ``--hold-plan`` simulates each row's own plan under the values instead of
planning again (what the value predicts for the measured plan, apart from what it would
choose). A change to the simulator is checked against every measurement on record the
same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import OURS, SUMMARY, WORKLOADS, OursConfig, planned_host_busy_s

GiB = 2**30
WITHIN = 0.15
"""The targets' bound on a predicted step's error against the run mean."""


def iter_rows(path: Path) -> Iterator[tuple[str, str, str, dict[str, Any]]]:
    """(file name, workload, kind, row) of every row in ``path``: an ``offload_bench.py``
    row file, a folder of them, or an older ``--json`` file (``{"results": {workload:
    {kind: row}}}``). Other JSON (a summary, which keeps no profile) is skipped."""
    files = sorted(p for p in path.glob("*.json") if p.name != SUMMARY) if path.is_dir() else [path]
    for file in files:
        doc = json.loads(file.read_text())
        if not isinstance(doc, dict):
            continue
        if {"workload", "kind", "result"} <= doc.keys():
            yield file.name, doc["workload"], doc["kind"], doc["result"]
        for workload, by_kind in (doc.get("results") or {}).items():
            for kind, row in by_kind.items():
                yield file.name, workload, kind, row


def row_config(kind: str, row: dict[str, Any]) -> OursConfig | None:
    """The configuration a row of ours ran: as it recorded it, else as its kind's name
    says (rows written before kinds were a table: ``_io`` fp16 I/O, ``bf16m`` bf16
    moments, ``spec`` speculation, ``_stream`` streamed); None for a peer's row or a kind
    that is not planned again (``ours_bf16``: bf16 training)."""
    recorded = row.get("config")
    if isinstance(recorded, dict):
        names = {f.name for f in dataclasses.fields(OursConfig)}
        fields: dict[str, Any] = {
            k: v if k == "host_state" else bool(v) for k, v in recorded.items()
        }
        if recorded.get("bf16_moments"):  # rows recorded before the ladder had rungs
            fields["host_state"] = "bf16_moments"
        return OursConfig(**{k: v for k, v in fields.items() if k in names})
    if kind in OURS:
        return OURS[kind]
    if not kind.startswith("ours") or kind == "ours_bf16":
        return None
    return OursConfig(
        fp16_io=kind.startswith("ours_io"),
        host_state="bf16_moments" if "bf16m" in kind else "fp32",
        speculate="spec" in kind,
        streamed=kind.endswith("_stream"),
    )


def row_hardware(
    row: dict[str, Any],
    host_adam_params_per_s: float | None = None,
    *,
    op_overhead_us: float | None = None,
) -> Any:
    """The ``HardwareProfile`` a row's plan was made with (its ``hardware``), with each
    figure given here in place of the row's: the host Adam rate and the per-operation issue
    cost (us). The cost model's factors that older rows' profiles carry are left to
    :func:`row_cost_model`."""
    from offload_solver import CostModel, HardwareProfile

    factors = {f.name for f in dataclasses.fields(CostModel)}
    measured = {k: v for k, v in row["hardware"].items() if k not in factors}
    hw = HardwareProfile.from_json(json.dumps(measured))
    changes: dict[str, Any] = {}
    if host_adam_params_per_s is not None:
        changes["host_adam_params_per_s"] = host_adam_params_per_s
    if op_overhead_us is not None:
        changes["op_overhead_s"] = op_overhead_us * 1e-6
    return dataclasses.replace(hw, **changes)


def row_cost_model(
    row: dict[str, Any],
    *,
    backward_issue: float | None = None,
    stream_up: float | None = None,
    stream_charge: float | None = None,
) -> Any:
    """The ``CostModel`` a row's plan was made with (its ``cost_model``; a row written
    before rows recorded one: the factors its ``hardware`` carried, 1 for any it lacks),
    with each factor given here in place of the row's: ``backward_issue_factor``,
    ``stream_up_fraction`` and ``stream_host_charge``."""
    from offload_solver import CostModel

    recorded = row.get("cost_model")
    if isinstance(recorded, dict):
        model = CostModel.from_json(json.dumps({"schema_version": 1, **recorded}))
    else:
        model = CostModel.from_hardware_json(json.dumps(row["hardware"]))
    changes: dict[str, Any] = {}
    if backward_issue is not None:
        changes["backward_issue_factor"] = backward_issue
    if stream_up is not None:
        changes["stream_up_fraction"] = stream_up
    if stream_charge is not None:
        changes["stream_host_charge"] = stream_charge
    return dataclasses.replace(model, **changes)


def host_rate(row: dict[str, Any], how: str) -> float | None:
    """The host Adam rate (parameters/s) to plan ``row`` with: None (the rate its plan was
    made with) for ``"recorded"`` or a row without rate samples, the median of the row's
    own samples of its kernel's rate for ``"samples"``."""
    if how not in ("recorded", "samples"):
        raise ValueError(f"how must be recorded or samples, not {how!r}")
    samples = row.get("host_rate_samples_gparam")
    if how == "recorded" or not samples:
        return None
    return float(statistics.median(samples)) * 1e9


def row_issue_cost_us(row: dict[str, Any], setting: float | str | None) -> float | None:
    """The per-operation issue cost (us) to replay ``row`` with: ``setting`` when it is a
    number; for ``"reads"`` the mean of the two reads the row took around its timed steps
    (``issue_cost_us_reads``), for ``"before"`` the first alone (taken before the timed
    steps, as a read at planning would be); None (the profile's own) for a row without
    them, or with no setting."""
    if setting not in ("reads", "before"):
        return None if setting is None else float(setting)
    reads = row.get("issue_cost_us_reads")
    if not reads:
        return None
    return float(reads[0]) if setting == "before" else float(statistics.mean(reads))


def loop_busy_ms(row: dict[str, Any]) -> float | None:
    """The host worker's busy time per step in the row's loop (ms), where it recorded one
    (``host_busy_ms``; older rows ``host_cycle``'s or their last step's)."""
    for value in (
        row.get("host_busy_ms"),
        (row.get("host_cycle") or {}).get("busy_ms"),
        row.get("host_step_ms_in_loop"),
    ):
        if value:
            return float(value)
    return None


def backward_issue_factor(backward_s: float, operations: int, op_overhead_s: float) -> float:
    """The ``backward_issue_factor`` at which issuing ``operations`` at ``op_overhead_s``
    each takes ``backward_s``, the host's time in a row's ``backward(loss)`` (at least 1):
    what the row's loop says the factor is, where its backward is bound by issuing."""
    return max(1.0, backward_s / (operations * op_overhead_s))


def _issue_cost_arg(text: str) -> float | str:
    if text in ("reads", "before"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"takes microseconds, 'reads' or 'before', got {text!r}"
        ) from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 microseconds, got {text!r}")
    return value


def workload_profile(
    workload: str, *, fuse_gelu: bool, device: str = "cuda", with_loss: bool = False
) -> Any:
    """The workload's ``ModelProfile``: its model traced on the meta device in fp16 for
    ``device`` (nothing allocated), its GELU fused into one operation as ``fuse_gelu``
    says, followed by its loss where ``with_loss`` says (rows that planned
    ``WithLMLoss``)."""
    import torch

    from offload_gpt_example.models import WithLMLoss, build_model, random_batch
    from offload_trace import trace

    name, batch, seq, _ = WORKLOADS[workload]
    model: torch.nn.Module = build_model(name, device="meta", dtype=torch.float16, seq_len=seq)
    if with_loss:
        model = WithLMLoss(model)
    inputs = random_batch(batch, seq, device="meta")
    traced = trace(model, inputs, dtype=torch.float16, target_device=device, fuse_gelu=fuse_gelu)
    return traced.to_profile()


def steady_run(variant: Any, hardware: Any, plan: Any, **simulation: Any) -> Any:
    """The repeating step of ``plan``'s placements simulated on ``hardware`` with the
    keyword arguments it was solved with, its cost model among them
    (``offload_solver.simulators._engine``'s ``SteadyState``: the simulator's internals,
    read here to set them beside a run)."""
    from offload_solver.simulators import RegionAssignment, SimulationContext, get_simulator
    from offload_solver.simulators._engine import steady_state

    ctx = SimulationContext.build(variant, hardware, **simulation)
    assignment = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
    return steady_state(ctx, assignment, get_simulator("async").run(ctx, assignment))


def simulated_pass_spans(steady: Any) -> dict[str, float]:
    """Seconds from the first start to the last end of the repeating step's forward
    (``fwd``) and backward (``bwd``) tasks on the compute lane, waits included: where the
    passes are bound by issuing operations (W2), the host's wall time in
    ``backward(loss)`` is the backward's span."""
    from offload_solver.simulators._engine import KINDS

    run = steady.last
    out: dict[str, float] = {}
    for what in ("fwd", "bwd"):
        tasks = [i for i, kind in enumerate(run.kind) if KINDS[kind] == what]
        if tasks:
            out[what] = max(run.end[i] for i in tasks) - min(run.start[i] for i in tasks)
    return out


def placements_line(plan: Any) -> str:
    """``plan``'s regions as ``r<index>:<placement>/<state>`` (``@<region>``: where an
    async region's backward prefetch is issued), space-separated."""
    return " ".join(
        f"r{i}:{rp.placement.value}/{rp.state.value}"
        + ("" if rp.prefetch_at is None else f"@{rp.prefetch_at}")
        for i, rp in enumerate(plan.regions)
    )


def _error(pred: float, measured: float) -> str:
    """``pred``'s error against ``measured`` in percent ("-" where nothing was measured)."""
    return f"{(pred - measured) / measured * 100:+.1f}%" if measured else "-"


def run_error_line(rows: str, errors: list[float]) -> str:
    """The summary of replayed steps against run means (``errors``, fractions) over
    ``rows`` (e.g. "2 rows", "14 W2 rows")."""
    within = sum(abs(e) <= WITHIN for e in errors)
    return (
        f"replayed against the run mean over {rows}: mean "
        f"{statistics.mean(errors) * 100:+.1f}%, mean absolute "
        f"{statistics.mean(abs(e) for e in errors) * 100:.1f}%, {within} within 15%"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "paths", nargs="+", type=Path, help="offload_bench.py row files or output folders"
    )
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="FILE:KIND",
        help="leave out a row (a file's name and a kind), e.g. a measurement of a bug fixed "
        "later; may be repeated",
    )
    parser.add_argument(
        "--host-rate",
        choices=("recorded", "samples", "loop"),
        default="recorded",
        help="the host Adam rate to plan rows with: the one their plan was made with "
        "(recorded), or the median of the kernel's own rate samples the row took "
        "(samples; rows without keep theirs). loop: the recorded rate scaled by the "
        "replayed host busy time over the one the row's loop measured, which is no "
        "prediction: what is left is the simulator's error with the host's speed known",
    )
    parser.add_argument(
        "--op-overhead-us",
        type=_issue_cost_arg,
        default=None,
        metavar="US|reads|before",
        help="replan every row with this per-operation issue cost (microseconds) instead "
        "of its profile's: how a launch-bound row's prediction (W1) follows the host. "
        "reads: each row's own reads around its timed steps; before: the read before them",
    )
    parser.add_argument(
        "--backward-issue-factor",
        type=float,
        default=None,
        metavar="F",
        help="replan every row with each backward operation of a step with host-state "
        "regions issued at F (>= 1) times the issue cost (CostModel.backward_issue_factor; "
        "the rows' own otherwise)",
    )
    parser.add_argument(
        "--stream-up-fraction",
        type=float,
        default=None,
        metavar="F",
        help="replan every row with streamed copies up at this fraction (0, 1] of the H2D "
        "rate (CostModel.stream_up_fraction)",
    )
    parser.add_argument(
        "--stream-host-charge",
        type=float,
        default=None,
        metavar="S",
        help="replan every row with this share [0, 1] of the streamed copies' host-memory "
        "contention charged to the host (CostModel.stream_host_charge)",
    )
    parser.add_argument(
        "--hold-plan",
        action="store_true",
        help="plan each row with its own recorded profile and simulate that plan with the "
        "options above: the replayed step is the measured plan's under them, not a new "
        "plan's",
    )
    parser.add_argument(
        "--placements",
        action="store_true",
        help="after each row, the replayed plan's placements, region by region",
    )
    args = parser.parse_args(argv)
    factor, up, charge = (
        args.backward_issue_factor,
        args.stream_up_fraction,
        args.stream_host_charge,
    )
    if factor is not None and not 1 <= factor < float("inf"):
        parser.error(f"--backward-issue-factor must be a finite factor >= 1, got {factor}")
    if up is not None and not 0 < up <= 1:
        parser.error(f"--stream-up-fraction must be in (0, 1], got {up}")
    if charge is not None and not 0 <= charge <= 1:
        parser.error(f"--stream-host-charge must be in [0, 1], got {charge}")
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        parser.error(f"no such file or folder: {', '.join(missing)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    from offload_runtime import PlanForce
    from offload_runtime.planning import device_conversion_profile, streamed_step_costs
    from offload_runtime.planning.planner import block_search_range
    from offload_solver import ParamPlacement, StatePlacement, StreamedStepCosts, solve

    traced: dict[tuple[str, bool, str, bool], Any] = {}
    cost_fields = {f.name for f in dataclasses.fields(StreamedStepCosts)}
    print(
        "| file | workload | kind | measured step (run mean) | predicted then (of run "
        "mean) | replayed now (of run mean) | measured peak | predicted then | replayed now "
        "| offloaded / host-state regions: measured; replayed | host busy per step: in the "
        "loop; replayed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {}
    """Replayed step over run mean, less 1, per workload."""
    for path in args.paths:
        for name, workload, kind, row in iter_rows(path):
            config = row_config(kind, row)
            if config is None or not row.get("ok") or "hardware" not in row:
                continue
            if f"{name}:{kind}" in args.exclude:
                print(f"| {name} | {workload} | {kind} | excluded |" + " |" * 7)
                continue
            key = (
                workload,
                bool(row.get("fuse_gelu")),
                str(row.get("device", "cuda")),
                bool(row.get("loss_in_module")),
            )
            if key not in traced:
                traced[key] = workload_profile(
                    workload, fuse_gelu=key[1], device=key[2], with_loss=key[3]
                )
            base = traced[key]
            variant = device_conversion_profile(base) if row.get("convert_on_device") else base
            budget = int(float(row.get("budget_gib", WORKLOADS[workload][3])) * GiB)
            simulation: dict[str, Any] = {
                # The planner's pool block-size search range for this model.
                "block_search_range_bytes": block_search_range(base, PlanForce()),
                "host_step_after_backward": not config.speculate,
                "speculative_step_cost": row.get("speculative_step_cost", 1.0),
                "speculative_params": row.get("speculative_params"),
                "speculation_thread": config.speculate and bool(row.get("speculation_thread")),
            }
            options = row.get("plan_options")
            if options:
                # A row that records its plan's options (the planner chose them).
                simulation["host_step_after_backward"] = options["host_step_after_backward"]
                simulation["speculation_thread"] = options["speculation_thread"]
            if config.streamed or row.get("plan_streamed"):
                recorded = row.get("plan_streamed")
                moments = torch.bfloat16 if config.host_state != "fp32" else torch.float32
                simulation["streamed"] = (
                    StreamedStepCosts(**{k: v for k, v in recorded.items() if k in cost_fields})
                    if recorded
                    else streamed_step_costs(moments, config.fp16_io, budget_bytes=budget)
                )
            planning = {
                **simulation,
                "solver": "asyn",
                "device_bytes_in_use": int(row.get("device_bytes_in_use") or 0),
                # Rows planned before host work was moved late record no such key.
                "late_host_work": bool(row.get("late_host_work", False)),
                "state_on_device": not config.reference,
                # As the planner: activations are recomputed or moved where keeping them
                # does not fit.
                "activations": True,
            }
            if options:
                planning["state_on_device"] = options["state_on_device"]
            rate = host_rate(row, "samples" if args.host_rate == "samples" else "recorded")
            issue_us = row_issue_cost_us(row, args.op_overhead_us)
            cost = row_cost_model(
                row,
                backward_issue=args.backward_issue_factor,
                stream_up=args.stream_up_fraction,
                stream_charge=args.stream_host_charge,
            )
            # With --hold-plan the row's plan: its own profile and cost model.
            plan_cost = row_cost_model(row) if args.hold_plan else cost
            hw = row_hardware(row, rate, op_overhead_us=issue_us)
            plan = solve(
                variant,
                row_hardware(row, rate) if args.hold_plan else hw,
                budget,
                cost_model=plan_cost,
                **planning,
            )
            in_loop = loop_busy_ms(row)
            if args.host_rate == "loop" and in_loop:
                scaled = hw.host_adam_params_per_s * planned_host_busy_s(plan) * 1e3 / in_loop
                hw = row_hardware(row, scaled, op_overhead_us=issue_us)
                plan_hw = row_hardware(row, scaled) if args.hold_plan else hw
                plan = solve(variant, plan_hw, budget, cost_model=plan_cost, **planning)
            steady = steady_run(variant, hw, plan, cost_model=cost, **simulation)
            replayed = (steady.period_s if args.hold_plan else plan.predicted_step_time_s) * 1e3
            run = float(row["step_mean_ms"])
            errors.setdefault(workload, []).append(replayed / run - 1)
            offloaded = sum(rp.placement is not ParamPlacement.RESIDENT for rp in plan.regions)
            host = sum(rp.state is not StatePlacement.DEVICE for rp in plan.regions)
            streamed = sum(rp.state is StatePlacement.STREAMED for rp in plan.regions)
            peak, peak_now = row["peak_alloc_gib"], plan.predicted_peak_bytes / GiB
            busy = f"{'-' if in_loop is None else f'{in_loop:.0f}'}; "
            busy += f"{planned_host_busy_s(plan) * 1e3:.0f} ms"
            print(
                f"| {name} | {workload} | {kind} | {row['step_ms']:.1f} ({run:.1f}) ms | "
                f"{row['pred_step_ms']:.1f} ({_error(row['pred_step_ms'], run)}) | "
                f"{replayed:.1f} ({_error(replayed, run)}) | {peak:.2f} GiB | "
                f"{row['pred_peak_gib']:.2f} ({_error(row['pred_peak_gib'], peak)}) | "
                f"{peak_now:.2f} ({_error(peak_now, peak)}) | "
                f"{row['offloaded_regions']} / {row['host_state_regions']}; {offloaded} / "
                f"{host}{f' ({streamed} streamed)' if streamed else ''} | {busy} |",
                flush=True,
            )
            cpu = row.get("cpu_span_ms")
            if cpu:
                sim = simulated_pass_spans(steady)
                factor = ""
                if hw.op_overhead_s > 0 and host:
                    ops = len(variant.operations)
                    loop = backward_issue_factor(cpu["backward"] / 1e3, ops, hw.op_overhead_s)
                    factor = (
                        f"; as a backward issue factor {loop:.1f} ({ops} operations at "
                        f"{hw.op_overhead_s * 1e6:.1f} us)"
                    )
                print(
                    f"    host span of backward(loss) {cpu['backward']:.1f} ms, forward "
                    f"{cpu['forward']:.1f} ms, step() {cpu['step']:.1f} ms; replayed backward "
                    f"{sim.get('bwd', 0.0) * 1e3:.1f} ms, forward {sim.get('fwd', 0.0) * 1e3:.1f} "
                    f"ms{factor}",
                    flush=True,
                )
            if args.placements:
                print(f"    placements: {placements_line(plan)}", flush=True)
    every = [e for errs in errors.values() for e in errs]
    if not every:
        print("no row of ours with its hardware profile in these files", file=sys.stderr)
        return 1
    print(run_error_line(f"{len(every)} rows", every))
    for workload, errs in sorted(errors.items()):
        print(run_error_line(f"{len(errs)} {workload} rows", errs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
