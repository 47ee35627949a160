"""How the measured streamed plans fare under other splits of host-memory contention.

    python benchmarks/stream_charge_fidelity.py benchmarks/results/s2[2-9]*.json \\
        benchmarks/results/s30*.json
    python benchmarks/stream_charge_fidelity.py --cross benchmarks/results/s30c2_W4_m.json

Host Adam and the pinned copies share host memory, and both slow down when they run at
once. The simulator charges the host for it (``HardwareProfile.host_copy_contention``;
for a STREAMED region's copies, ``stream_host_charge`` of that, 1 by default), and can run
the streamed regions' copies up at ``stream_up_fraction`` of the H2D rate (1 by default).
A model is a pair ``S:F`` of the two.

Part 1 (the default): every streamed row (a ``_stream`` kind planned so) is replanned as
it was recorded, exactly as ``replay_bench.py`` does, and kept only if that reproduces
the number of regions it streamed. Its plan (not a new one) is then simulated under each
``--model``, and the steady-state period and the host lane's busy time are set beside the
row's run mean, 5 fastest steps and measured host busy time (``host_cycle``). It prints
each model's mean and mean absolute error over the rows.

Part 2 (``--cross FILE``): each streamed row of FILE is planned under each model, and
each of those plans is simulated under every model: whether the models agree on which
plan is fastest. Nothing is allocated; no GPU is needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import WORKLOADS
from replay_bench import (
    SPECULATING,
    host_rate,
    loop_busy_ms,
    row_hardware,
    row_simulation,
    steady_run,
    workload_profile,
)

GiB = 2**30
DEFAULT_MODELS = ("1:1", "1:0.78", "0.5:1", "0.5:0.78", "0:0.78")


def parse_model(text: str) -> tuple[float, float]:
    """``"S:F"`` -> (stream_host_charge, stream_up_fraction), each checked."""
    try:
        charge_text, up_text = text.split(":")
        charge, up = float(charge_text), float(up_text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a model is S:F, e.g. 0.5:0.78; got {text!r}") from exc
    if not 0 <= charge <= 1 or not 0 < up <= 1:
        raise argparse.ArgumentTypeError(f"S must be in [0, 1] and F in (0, 1]; got {text!r}")
    return charge, up


@dataclasses.dataclass
class Row:
    """One streamed row, its plan replanned as recorded and what it measured."""

    name: str
    row: dict[str, Any]
    variant: Any
    hardware: Any
    simulation: dict[str, Any]
    plan: Any


def streamed_rows(paths: list[Path], kinds: list[str] | None = None) -> tuple[list[Row], int]:
    """The streamed rows of ``paths`` (of ``kinds`` only, when given) whose recorded plan
    replans to the same number of streamed regions, and how many did not."""
    from offload_solver import StreamedStepCosts, solve

    traced: dict[str, Any] = {}
    rows: list[Row] = []
    skipped = 0
    for path in paths:
        document = json.loads(path.read_text())
        if not isinstance(document, dict) or "results" not in document:
            continue
        for workload, by_kind in document["results"].items():
            for kind, row in by_kind.items():
                if not (
                    kind.endswith("_stream")
                    and isinstance(row, dict)
                    and row.get("ok")
                    and row.get("stream_from") == "plan"
                    and "hardware" in row
                    and row.get("plan_streamed")
                    and not row.get("convert_on_device")
                    and (kinds is None or kind in kinds)
                ):
                    continue
                if workload not in traced:
                    traced[workload] = workload_profile(workload)
                variant = traced[workload]
                rate = host_rate(row, row["profile"]["host_adam_gparam"], "recorded")
                hardware = row_hardware(row, rate)
                speculate = kind.removesuffix("_stream") in SPECULATING
                simulation = row_simulation(row, speculate)
                simulation["streamed"] = StreamedStepCosts(**row["plan_streamed"])
                plan = solve(
                    variant,
                    hardware,
                    WORKLOADS[workload][3] * GiB,
                    solver="asyn",
                    device_bytes_in_use=int(row.get("device_bytes_in_use", 0)),
                    **simulation,
                )
                streamed = sum(rp.state.value == "streamed" for rp in plan.regions)
                if streamed != row.get("streamed_regions"):
                    skipped += 1
                    continue
                name = f"{path.name}:{workload}:{kind}"
                rows.append(Row(name, row, variant, hardware, simulation, plan))
    return rows, skipped


def simulate(
    variant: Any, hardware: Any, plan: Any, simulation: dict[str, Any]
) -> tuple[float, float]:
    """(steady-state period, host lane busy time in that step), ms, of ``plan``'s
    placements simulated on ``hardware``."""
    from offload_solver.simulators._engine import LANE_HOST

    steady = steady_run(variant, hardware, plan, **simulation)
    run = steady.last
    busy = sum(run.end[i] - run.start[i] for i, lane in enumerate(run.lane) if lane == LANE_HOST)
    return steady.period_s * 1e3, busy * 1e3


def with_model(hardware: Any, model: tuple[float, float]) -> Any:
    return dataclasses.replace(hardware, stream_host_charge=model[0], stream_up_fraction=model[1])


def fidelity(rows: list[Row], models: list[tuple[float, float]], verbose: bool) -> None:
    """Part 1: each model's errors over the rows' own plans."""
    errors: dict[tuple[float, float], dict[str, list[float]]] = {
        m: {"run": [], "fast": [], "busy": []} for m in models
    }
    for r in rows:
        cells = []
        for m in models:
            period, busy = simulate(r.variant, with_model(r.hardware, m), r.plan, r.simulation)
            errors[m]["run"].append(period / r.row["step_mean_ms"] - 1)
            errors[m]["fast"].append(period / r.row["step_ms"] - 1)
            measured_busy = loop_busy_ms(r.row)
            if measured_busy:
                errors[m]["busy"].append(busy / measured_busy - 1)
            cells.append(f"{m[0]:g}:{m[1]:g} {period:.0f}/{busy:.0f}")
        if verbose:
            busy_cell = loop_busy_ms(r.row)
            print(
                f"{r.name}: run {r.row['step_mean_ms']:.0f}, 5 fastest {r.row['step_ms']:.0f}, "
                f"host busy {'-' if busy_cell is None else f'{busy_cell:.0f}'} ms; "
                "simulated step/host busy: " + ", ".join(cells)
            )

    def summary(values: list[float]) -> str:
        if not values:
            return "-"
        mean = statistics.mean(values) * 100
        mae = statistics.mean(abs(v) for v in values) * 100
        return f"{mean:+.1f}% (mean absolute {mae:.1f}%)"

    print(
        "| stream_host_charge : stream_up_fraction | step against the run mean | "
        "against the 5 fastest | largest against the run mean | host busy against the "
        "measured |"
    )
    print("|---|---|---|---|---|")
    for m in models:
        e = errors[m]
        largest = max(abs(v) for v in e["run"]) * 100
        print(
            f"| {m[0]:g} : {m[1]:g} | {summary(e['run'])} | {summary(e['fast'])} | "
            f"{largest:.1f}% | {summary(e['busy'])} |"
        )


def cross(rows: list[Row], models: list[tuple[float, float]]) -> None:
    """Part 2: plans made under each model, simulated under every model."""
    from offload_solver import solve

    for r in rows:
        workload = r.name.split(":")[1]
        print(
            f"{r.name}: measured {r.row['step_ms']:.0f} ms (run {r.row['step_mean_ms']:.0f}) "
            f"with {r.row['streamed_regions']} streamed"
        )
        print(
            "| planned under | streamed regions | "
            + " | ".join(f"simulated under {m[0]:g}:{m[1]:g}" for m in models)
            + " |"
        )
        print("|---|---|" + "---|" * len(models))
        for m in models:
            plan = solve(
                r.variant,
                with_model(r.hardware, m),
                WORKLOADS[workload][3] * GiB,
                solver="asyn",
                device_bytes_in_use=int(r.row.get("device_bytes_in_use", 0)),
                **r.simulation,
            )
            streamed = sum(rp.state.value == "streamed" for rp in plan.regions)
            periods = [
                simulate(r.variant, with_model(r.hardware, m2), plan, r.simulation)[0]
                for m2 in models
            ]
            print(
                f"| {m[0]:g}:{m[1]:g} | {streamed} | "
                + " | ".join(f"{p:.0f} ms" for p in periods)
                + " |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, nargs="*", help="offload_bench.py --json files")
    parser.add_argument(
        "--model",
        type=parse_model,
        action="append",
        metavar="S:F",
        help="stream_host_charge:stream_up_fraction to simulate with; may be repeated "
        f"(default: {', '.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--cross",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="part 2 for FILE's streamed rows; may be repeated",
    )
    parser.add_argument(
        "--kind",
        action="append",
        metavar="KIND",
        help="only rows of this kind, e.g. ours_io_bf16m_spec1_stream; may be repeated",
    )
    parser.add_argument("--rows", action="store_true", help="print each row's figures too")
    args = parser.parse_args(argv)
    models: list[tuple[float, float]] = args.model or [parse_model(m) for m in DEFAULT_MODELS]
    if not args.json and not args.cross:
        parser.error("give benchmark JSON files, or --cross FILE")
    if args.json:
        rows, skipped = streamed_rows(args.json, args.kind)
        if not rows:
            print("no streamed row replans as it was recorded", file=sys.stderr)
            return 1
        print(
            f"{len(rows)} streamed rows replanned as recorded "
            f"({skipped} left out: replanned to another number of streamed regions)"
        )
        fidelity(rows, models, args.rows)
    if args.cross:
        rows, _ = streamed_rows(args.cross, args.kind)
        cross(rows, models)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
