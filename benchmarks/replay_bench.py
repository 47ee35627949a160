"""Re-predict measured benchmark rows with this tree's planner (nothing is allocated).

    python benchmarks/replay_bench.py W3_io.json W2_io.json

For every ``ours*`` row of ``offload_bench.py --json`` files that recorded the hardware
profile its plan was made with, this traces the workload on the meta device, solves it
again with that profile (the whole profile where the row records it, from session 20 on;
else ``plan_predict.replay_hardware``: the default bandwidth curves scaled to the
measured plateaus) and the row's own choices (dtype conversion on the
device or the host, speculation and its measured step cost, fp16 I/O), and prints the
measured step and peak beside the predictions the benchmark made and those of this tree
(planned with the device memory in use that the row records; rows from before session 18
do not, so ``--in-use-mib`` stands in for them), and where the host worker waits in each
step, measured and in the replayed plan's repeating step (:func:`simulated_host_cycle`).
A change to the simulator can so be checked against every measurement on record without
a GPU. The replayed plan is solved again, so it can differ from the measured one; its
placements are printed when they do.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import WORKLOADS
from plan_predict import add_compute_model_args, replay_hardware, with_compute_model

GiB = 2**30
SPECULATING = ("ours_spec", "ours_spec1", "ours_io_spec1", "ours_io_bf16m_spec1")
FP16_IO = ("ours_io", "ours_io_spec1", "ours_io_bf16m", "ours_io_bf16m_spec1")
REPLAYED = tuple(
    dict.fromkeys(("ours", "ours_hostconv", "ours_bf16m", "ours_bf16m1", *SPECULATING, *FP16_IO))
)
"""Kinds this script knows how to plan again (``ours_bf16`` and ``ablation`` are not), each
also with the ``_stream`` suffix (streamed host steps, planned so)."""


def replays_streamed(kind: str, *, streamed: bool, unstreamed: bool) -> bool:
    """Whether a row of ``kind`` is replanned with streamed host steps: as its kind says
    (the ``_stream`` suffix), unless ``--streamed`` or ``--unstreamed`` says otherwise."""
    if unstreamed:
        return False
    return streamed or kind.endswith("_stream")


def workload_traced(workload: str, *, fuse_gelu: bool = False) -> Any:
    """The workload's ``TracedModel``: its model traced on the meta device in fp16 for
    CUDA (nothing allocated); ``fuse_gelu`` as ``offload_trace.trace`` takes it."""
    import torch

    from offload_gpt_example.models import build_model, random_batch
    from offload_trace import trace

    name, batch, seq, _ = WORKLOADS[workload]
    model = build_model(name, device="meta", dtype=torch.float16, seq_len=seq)
    inputs = random_batch(batch, seq, device="meta")
    return trace(model, inputs, dtype=torch.float16, target_device="cuda", fuse_gelu=fuse_gelu)


def workload_profile(workload: str, *, fuse_gelu: bool = False) -> Any:
    """The workload's ``ModelProfile`` (``workload_traced``'s)."""
    return workload_traced(workload, fuse_gelu=fuse_gelu).to_profile()


def row_simulation(row: dict[str, Any], speculate: bool) -> dict[str, Any]:
    """The step-shaping arguments of ``offload_solver.solve`` a row ran with, from its JSON:
    whether its host steps waited for backward's end (not when ``speculate``), what a
    speculative step cost, how many parameters could speculate, and whether the
    speculative steps ran on their own thread (rows before session 41: in the hooks)."""
    return {
        "host_step_after_backward": not speculate,
        "speculative_step_cost": row.get("speculative_step_cost", 1.0),
        # A speculating row planned for fewer undo buffers records the limit.
        "speculative_params": row.get("speculative_params"),
        "speculation_thread": speculate and bool(row.get("speculation_thread", False)),
    }


def row_hardware(
    row: dict[str, Any],
    host_adam_gparam: float,
    *,
    op_overhead_us: float | None = None,
    stream_up: float | None = None,
    stream_charge: float | None = None,
    backward_issue: float | None = None,
    compute_model: argparse.Namespace | None = None,
) -> Any:
    """The ``HardwareProfile`` a benchmark row's plan was made with, its host Adam rate
    set to ``host_adam_gparam`` (and its per-operation issue cost to ``op_overhead_us``,
    its ``stream_up_fraction`` to ``stream_up``, its ``stream_host_charge`` to
    ``stream_charge``, its ``backward_issue_factor`` to ``backward_issue``, when given; and
    ``compute_model``'s options,
    ``plan_predict.with_compute_model``): the whole profile
    where the row records it (from
    session 20 on), else the row's figures on the default bandwidth curves scaled to its
    plateaus (``plan_predict.replay_hardware``)."""
    hw = _row_hardware(row, host_adam_gparam, op_overhead_us)
    if stream_up is not None:
        hw = dataclasses.replace(hw, stream_up_fraction=stream_up)
    if stream_charge is not None:
        hw = dataclasses.replace(hw, stream_host_charge=stream_charge)
    if backward_issue is not None:
        hw = dataclasses.replace(hw, backward_issue_factor=backward_issue)
    if compute_model is not None:
        hw = with_compute_model(hw, compute_model)
    return hw


def _row_hardware(
    row: dict[str, Any], host_adam_gparam: float, op_overhead_us: float | None
) -> Any:
    from offload_solver import HardwareProfile

    p = row["profile"]
    overhead_us = p["op_overhead_us"] if op_overhead_us is None else op_overhead_us
    if "hardware" in row:
        return dataclasses.replace(
            HardwareProfile.from_json(json.dumps(row["hardware"])),
            host_adam_params_per_s=host_adam_gparam * 1e9,
            op_overhead_s=overhead_us * 1e-6,
        )
    return replay_hardware(
        op_overhead_us=overhead_us,
        host_convert_gelem=p["host_convert_gelem"],
        host_adam_gparam=host_adam_gparam,
        h2d_gbps=p["h2d_gbps"],
        d2h_gbps=p["d2h_gbps"],
        peak_tflops=p["peak_tflops"],
        efficiency=p["efficiency"],
        hbm_tbps=p["device_memory_tbps"],
        host_copy_contention=p["host_copy_contention"],
    )


def steady_run(variant: Any, hardware: Any, plan: Any, **simulation: Any) -> Any:
    """The repeating step (``offload_solver.simulators._engine.SteadyState``) of ``plan``'s
    placements simulated on ``hardware`` with the keyword arguments it was solved with.
    The steady state and its lanes are the simulator's internals: the scripts read them to
    set them beside what a run measured, nothing more."""
    from offload_solver.simulators import RegionAssignment, SimulationContext, get_simulator
    from offload_solver.simulators._engine import steady_state

    ctx = SimulationContext.build(variant, hardware, **simulation)
    assignment = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
    return steady_state(ctx, assignment, get_simulator("async").run(ctx, assignment))


def simulated_host_cycle(steady: Any) -> tuple[float, float, int]:
    """Where the simulated host worker waits in a plan's repeating step (``steady``, from
    :func:`steady_run`; seconds):

    - from the compute lane's backward start (or the host's last step of the step
      before, if that is later) to the host's first region step of this backward;
    - from the host's last region step (of the step before) to that backward start, i.e.
      the rest of the forward that nothing is left to step under;
    - how many regions step before the step's last gradient copy lands (under backward).

    Comparable with a row's ``backward_to_first_host_step_ms``, ``host_cycle`` (or the
    run's period minus the delay and the span) and ``speculated_regions``."""
    from offload_solver.simulators._engine import KIND_HOST_STEP, LANE_HOST

    run = steady.last
    backward = min(run.reach_b)
    host = [i for i, lane in enumerate(run.lane) if lane == LANE_HOST]
    if not host:
        return 0.0, 0.0, 0
    # As the bench's host_cycle counts them: the idle after the last host step ends at the
    # next backward (never below 0), the delay runs from whichever of the two is later.
    last_end = run.host_free_end - steady.period_s  # in this step's time
    tail = max(0.0, backward - last_end)
    delay = min(run.start[i] for i in host) - max(backward, last_end)
    under = sum(run.kind[i] == KIND_HOST_STEP and run.start[i] < run.d2h_free_end for i in host)
    return delay, tail, under


def lane_window(steady: Any, until_s: float) -> list[tuple[str, str, int, float, float]]:
    """The tasks of ``steady``'s repeating step (``SteadyState.last``) that start before
    ``until_s`` on the copy lanes and the compute lane, in start order: (lane, kind,
    region, start s, end s), times from the step's start. Consecutive forward or backward
    tasks of the compute lane are merged into one span, so that its idle gaps show."""
    from offload_solver.simulators._engine import KINDS, LANES

    run = steady.last
    out: list[tuple[str, str, int, float, float]] = []
    pass_at: int | None = None  # where in ``out`` the compute lane's last task is
    for i in sorted(range(len(run.lane)), key=lambda i: (run.start[i], i)):
        lane, kind = LANES[run.lane[i]].value, KINDS[run.kind[i]]
        if run.start[i] >= until_s or lane == "host":
            continue
        if lane == "compute":
            if pass_at is not None and kind in ("fwd", "bwd"):
                last = out[pass_at]
                if last[1] == kind and run.start[i] - last[4] < 1e-6:
                    out[pass_at] = (lane, kind, run.region[i], last[3], run.end[i])
                    continue
            pass_at = len(out)
        out.append((lane, kind, run.region[i], run.start[i], run.end[i]))
    return out


def simulated_pass_spans(steady: Any) -> dict[str, float]:
    """Seconds from the first to the last end of ``steady``'s repeating step's forward
    (``fwd``) and backward (``bwd``) tasks on the compute lane: the span of each pass,
    waits inside it included. Comparable with a row's ``cpu_span_ms`` where the passes are
    bound by issuing operations (W2), as the host's wall time in ``backward(loss)`` is
    the backward's span there."""
    from offload_solver.simulators._engine import KINDS

    run = steady.last
    out: dict[str, float] = {}
    for what in ("fwd", "bwd"):
        tasks = [i for i, kind in enumerate(run.kind) if KINDS[kind] == what]
        if tasks:
            out[what] = max(run.end[i] for i in tasks) - min(run.start[i] for i in tasks)
    return out


def lane_busy(steady: Any) -> dict[tuple[str, str], tuple[int, float]]:
    """Per (lane, kind), how many tasks ``steady``'s repeating step runs and their busy
    seconds: what the simulator has each lane do in a step, beside a trace's busy times."""
    from offload_solver.simulators._engine import KINDS, LANES

    run = steady.last
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for i, lane in enumerate(run.lane):
        key = (LANES[lane].value, KINDS[run.kind[i]])
        n, busy = out.get(key, (0, 0.0))
        out[key] = (n + 1, busy + run.end[i] - run.start[i])
    return out


def measured_host_cycle(row: dict[str, Any]) -> tuple[float, float] | None:
    """(delay from backward's call to the first host step, idle from the host's last step to
    the next backward's call), ms, as a row records them: ``host_cycle`` medians where
    present (recorded from ``cec68b5`` on; session 21's rows are the first), else the last
    timed step's delay and host span with the run's mean step as the period; None when
    the row has neither."""
    cycle = row.get("host_cycle")
    if cycle:
        return float(cycle["idle_before_first_ms"]), float(cycle["idle_after_last_ms"])
    if "backward_to_first_host_step_ms" not in row or "host_step_span_ms" not in row:
        return None
    delay = float(row["backward_to_first_host_step_ms"])
    period = float(row.get("step_mean_ms", row["step_ms"]))
    return delay, max(0.0, period - delay - float(row["host_step_span_ms"]))


def loop_busy_ms(row: dict[str, Any]) -> float | None:
    """The host worker's busy time per step in the row's loop, ms: ``host_cycle``'s median
    where the row records it (session 21's rows are the first), else the last timed
    step's host region steps (``host_step_ms_in_loop``); None when the row has neither."""
    cycle = row.get("host_cycle")
    if cycle and cycle.get("busy_ms"):
        return float(cycle["busy_ms"])
    busy = row.get("host_step_ms_in_loop")
    return float(busy) if busy else None


def host_rate(row: dict[str, Any], recorded_gparam: float, how: str) -> float:
    """The host rate, Gparam/s, to replay ``row`` with: ``recorded_gparam`` (``how ==
    "recorded"`` or a row without rate samples), the median of the row's own samples of
    its kernel's rate (``"samples"``), or the geometric mean of the two (``"blend"``, what
    the bench plans with from session 21's third call on, so such rows keep theirs).
    Rows from session 19 until then recorded the profile's fused fp32 rate over the
    kernel's measured cost, so the two are read from different timings."""
    if how not in ("recorded", "samples", "blend"):
        raise ValueError(f"how must be recorded, samples or blend, not {how!r}")
    samples = row.get("host_rate_samples_gparam")
    if how == "recorded" or not samples:
        return recorded_gparam
    median = float(statistics.median(samples))
    if how == "samples":
        return median
    if row.get("host_rate_planned_from") == "blend":
        return recorded_gparam  # planned with the mean already (session 21 on)
    return float((median * recorded_gparam) ** 0.5)


def row_issue_cost_us(row: dict[str, Any], setting: float | str | None) -> float | None:
    """The per-operation issue cost (us) to replay ``row`` with: ``setting`` when it is a
    number; for ``"reads"`` the mean of the two reads the row took around its timed steps
    (``issue_cost_us_reads``, recorded from session 36's code on), for ``"before"`` the
    first of them alone (taken before the timed steps, as a read at planning would be), or
    None (the profile's own) for a row without them; None: the profile's own."""
    if setting not in ("reads", "before"):
        return None if setting is None else float(setting)
    reads = row.get("issue_cost_us_reads")
    if not reads:
        return None
    return float(reads[0]) if setting == "before" else float(statistics.mean(reads))


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


def _restate_arg(text: str) -> dict[int, str]:
    """``--restate``'s ``R=STATE,...``: region index -> state name."""
    out: dict[int, str] = {}
    for item in text.split(","):
        r, sep, state = item.partition("=")
        if not sep or not r.strip().isdigit() or state not in ("device", "host", "streamed"):
            raise argparse.ArgumentTypeError(
                f"{item!r}: give R=STATE, R a region index, STATE device, host or streamed"
            )
        out[int(r)] = state
    return out


def placements_line(plan: Any) -> str:
    """``plan``'s regions as ``r<index>:<placement>/<state>`` (``@<region>``: where an
    async region's backward prefetch is issued), space-separated."""
    return " ".join(
        f"r{i}:{rp.placement.value}/{rp.state.value}"
        + ("" if rp.prefetch_at is None else f"@{rp.prefetch_at}")
        for i, rp in enumerate(plan.regions)
    )


def restate_line(
    variant: Any, hardware: Any, plan: Any, changes: dict[int, str], **simulation: Any
) -> str:
    """``plan`` with the regions in ``changes`` given those optimizer states, simulated
    as :func:`steady_run` does: its repeating step, or why it cannot run."""
    from offload_solver.model import StatePlacement

    label = ", ".join(f"r{r} {state}" for r, state in sorted(changes.items()))
    bad = [r for r in changes if not 0 <= r < len(plan.regions)]
    if bad:
        return f"restated ({label}): no region {bad[0]} (the plan has {len(plan.regions)})"
    regions = [
        dataclasses.replace(rp, state=StatePlacement(changes[i])) if i in changes else rp
        for i, rp in enumerate(plan.regions)
    ]
    try:
        steady = steady_run(
            variant, hardware, dataclasses.replace(plan, regions=regions), **simulation
        )
    except ValueError as exc:
        return f"restated ({label}): {exc}"
    return f"restated ({label}): repeating step {steady.period_s * 1e3:.1f} ms"


@contextlib.contextmanager
def state_ahead(regions: int) -> Iterator[None]:
    """Within it, every simulation (the solver's and the replay's) takes the copies up of
    the state of streamed regions below index ``regions`` off the step: only their
    gradient's bytes go up then (a resident streamed region's copy down carries the state:
    ``StreamedStepCosts.resident_down_bytes_per_param`` of ``up_bytes_per_param``). An
    upper bound on ``HybridAdam(stage_in_backward=True)``: the state's copies in the
    backward before and the ring's memory there cost nothing ([Note: staging the state in
    backward] in offload_optim/streamed.py). It reaches into the simulator's internals,
    as :func:`steady_run` does. 0: nothing changes."""
    from offload_solver.simulators import SimulationContext

    if regions <= 0:
        yield
        return
    init = SimulationContext.__init__

    def ahead(self: SimulationContext, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        costs = kwargs.get("streamed")
        if costs is None or not costs.resident_down_bytes_per_param:
            return
        keep = 1 - costs.resident_down_bytes_per_param / costs.up_bytes_per_param
        self.stream_up_s = [t * keep if i < regions else t for i, t in enumerate(self.stream_up_s)]

    SimulationContext.__init__ = ahead  # type: ignore[method-assign]
    try:
        yield
    finally:
        SimulationContext.__init__ = init  # type: ignore[method-assign]


def _error(pred: float, measured: float) -> str:
    return f"{(pred - measured) / measured * 100:+.1f}%"


def run_error_line(rows: str, errors: list[float]) -> str:
    """The summary of replayed steps against run means (``errors``, fractions) over
    ``rows`` (e.g. "2 rows", "14 W2 rows")."""
    within = sum(abs(e) <= 0.15 for e in errors)
    return (
        f"replayed against the run mean over {rows}: mean "
        f"{statistics.mean(errors) * 100:+.1f}%, mean absolute "
        f"{statistics.mean(abs(e) for e in errors) * 100:.1f}%, {within} within 15%"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+", type=Path, help="offload_bench.py --json files")
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="FILE:KIND",
        help="leave out a row (a file's name and a kind), e.g. a measurement of a bug since "
        "fixed; may be repeated",
    )
    parser.add_argument(
        "--in-use-mib",
        type=float,
        default=0.0,
        help="device MiB in use beside the plan for rows that do not record it (before "
        "session 17 none was counted; session 17's rows were planned with a measured amount "
        "that their JSON lacks)",
    )
    parser.add_argument(
        "--host-step-cost",
        action="append",
        default=[],
        metavar="KIND=COST",
        help="plan rows of KIND with the host rate --fused-gparam / COST instead of the rate "
        "they recorded (what memory_optimize(host_step_cost=) does); may be repeated, e.g. "
        "--host-step-cost ours_io=1.056",
    )
    parser.add_argument(
        "--fused-gparam",
        type=float,
        default=None,
        help="torch's fused fp32 host Adam rate, Gparam/s, that --host-step-cost divides "
        "(the machine's profile; session 18: 4.39)",
    )
    parser.add_argument(
        "--placements",
        action="store_true",
        help="after each row, the replayed plan's placements, region by region: "
        "r<index>:<placement>/<state>, with @<region> for where an async region's backward "
        "prefetch is issued",
    )
    parser.add_argument(
        "--late-host-work",
        choices=("recorded", "yes", "no"),
        default="recorded",
        help="plan with solve(late_host_work=) as the row was (recorded; rows before "
        "session 51: no), or with it on or off",
    )
    parser.add_argument(
        "--host-margin",
        type=float,
        default=1.0,
        metavar="M",
        help="replan every row for a host Adam step M (>= 1) times slower than the rate "
        "chosen by --host-rate (what offload_bench.py's BENCH_HOST_MARGIN plans with; rows "
        "planned with a margin recorded the slowed rate, which the default 1 keeps)",
    )
    parser.add_argument(
        "--host-rate",
        choices=("recorded", "samples", "blend", "loop"),
        default="recorded",
        help="the host rate to plan rows with: the one their plan was made with "
        "(recorded), the median of the kind's own rate samples the row took "
        "(host_rate_samples_gparam: samples), or the geometric mean of the two (blend); "
        "rows without samples keep the recorded rate. loop: the rate the host steps ran "
        "at in the row's own loop (the recorded rate scaled by the replayed host busy time "
        "over the measured one), which is no prediction: what is left is the simulator's "
        "error with the host's speed known",
    )
    parser.add_argument(
        "--lanes",
        type=float,
        default=None,
        metavar="MS",
        help="after each row, the replayed plan's repeating step on the copy lanes and the "
        "compute lane for its first MS ms (lane_window), and each lane's busy time by "
        "kind over the step (lane_busy): what the simulator has the forward wait for, "
        "beside copy_lag.py --window on the row's trace",
    )
    streaming = parser.add_mutually_exclusive_group()
    streaming.add_argument(
        "--streamed",
        action="store_true",
        help="plan every row as if its kind had the _stream suffix: what streaming host "
        "steps through the GPU would predict on the row's measured profile",
    )
    streaming.add_argument(
        "--unstreamed",
        action="store_true",
        help="plan every row as if its kind lacked the _stream suffix: every host-state "
        "region stepped by the host, what the row's profile predicts without streaming",
    )
    parser.add_argument(
        "--write-resident",
        choices=("recorded", "yes", "no"),
        default="recorded",
        help="streamed rows' resident regions: as the row's optimizer did (written on the "
        "device from session 38 on unless BENCH_STREAM_WRITE=0, uploaded after their "
        "downloads before), or replanned written on the device (yes) or uploaded (no)",
    )
    parser.add_argument(
        "--stage-in-backward",
        choices=("recorded", "yes", "no"),
        default="recorded",
        help="streamed rows: planned with the leading chunks' state going up in the "
        "backward as the row's optimizer did (its stage_in_backward, from session 44 on), "
        "or replanned with it (yes) or without (no); with_stage_in_backward()",
    )
    parser.add_argument(
        "--stream-ring",
        choices=("recorded", "budget"),
        default="recorded",
        help="the ring of streamed rows: as their plan recorded it (plan_streamed; before "
        "it was recorded, 16 M-element chunks), or sized to the budget as the bench sizes "
        "it now (streamed_step_costs(budget_bytes=))",
    )
    parser.add_argument(
        "--stream-slots",
        type=int,
        default=None,
        metavar="N",
        help="streamed rows: a ring of N buffer sets, as BENCH_STREAM_SLOTS=N builds it "
        "(with staging, N chunks staged in the backward); sizes the ring as "
        "--stream-ring budget does",
    )
    parser.add_argument(
        "--speculate",
        type=float,
        default=None,
        metavar="GPARAMS",
        help="plan every row as a speculating kind (host steps start in their gradient "
        "hooks) with undo buffers for this many G parameters (what host memory holds "
        "beside the state), at --speculative-step-cost: what ours_io_spec1 would predict "
        "where ours_io was measured",
    )
    parser.add_argument(
        "--speculative-step-cost",
        type=float,
        default=1.25,
        help="with --speculate, for rows that did not measure one (default 1.25, about "
        "what session 23's W4 rows measured: 1.25-1.44)",
    )
    parser.add_argument(
        "--speculative-step-cost-all",
        type=float,
        default=None,
        metavar="COST",
        help="replan the speculating rows with this speculative step cost instead of the "
        "one each measured alone (the traces of session 24 time speculative steps at "
        "1.02-1.09x plain ones in the loop, against 1.23-1.26x alone)",
    )
    parser.add_argument(
        "--op-overhead-us",
        type=_issue_cost_arg,
        default=None,
        metavar="US|reads|before",
        help="replan every row with this per-operation issue cost (microseconds) instead "
        "of the one its profile read: how a launch-bound row's prediction (W1) follows the "
        "probe. reads: each row's own reads, taken just before and after its timed steps "
        "(issue_cost_us_reads; rows without them keep their profile's); before: the read "
        "before the timed steps alone (what a read at planning would have seen)",
    )
    parser.add_argument(
        "--stream-up-fraction",
        type=float,
        default=None,
        metavar="F",
        help="replan every row with streamed copies up at this fraction of the H2D rate "
        "(HardwareProfile.stream_up_fraction) instead of the row's own (1 before session "
        "28's change; its traces read 0.69-0.74, benchmarks/copy_lag.py)",
    )
    parser.add_argument(
        "--stream-host-charge",
        type=float,
        default=None,
        metavar="S",
        help="replan every row with this share of the streamed copies' host contention "
        "charged to the host (HardwareProfile.stream_host_charge) instead of the row's own "
        "(1 before session 30)",
    )
    parser.add_argument(
        "--backward-issue-factor",
        type=float,
        default=None,
        metavar="F",
        help="replan every row with each backward operation of a step with host-state "
        "regions issued at F times the per-operation issue cost "
        "(HardwareProfile.backward_issue_factor; rows so far were planned at 1)",
    )
    add_compute_model_args(parser, "replan every row")
    parser.add_argument(
        "--fuse-gelu",
        action="store_true",
        help="trace every workload with its written-out tanh GELU fused into one aten.gelu "
        "(memory_optimize(fuse_gelu=True)): what the rows would predict with it. Rows that "
        "ran with it (fuse_gelu in the row) are replayed so either way",
    )
    parser.add_argument(
        "--hold-plan",
        action="store_true",
        help="plan each row with its own recorded profile, leaving out --op-overhead-us, "
        "--stream-up-fraction and --stream-host-charge, and simulate that plan with them: "
        "the replayed step is then the measured plan's under the other model, not a new "
        "plan's",
    )
    parser.add_argument(
        "--streamed-only",
        action="store_true",
        help="replay only the rows whose plan streamed (a _stream kind planned so, "
        "stream_from 'plan')",
    )
    parser.add_argument(
        "--restate",
        action="append",
        default=[],
        type=_restate_arg,
        metavar="R=STATE[,R=STATE...]",
        help="also simulate each replayed plan with these regions' optimizer state changed "
        "(STATE: device, host or streamed; R: the region's index in forward order) and "
        "print its repeating step; may be repeated",
    )
    parser.add_argument(
        "--state-ahead",
        type=int,
        default=0,
        metavar="R",
        help="replan and replay every row with the streamed state of regions below index R "
        "copied up ahead of the step for free, only its gradients at the step (an upper "
        "bound on HybridAdam(stage_in_backward=True); state_ahead())",
    )
    args = parser.parse_args(argv)
    if args.state_ahead < 0:
        parser.error(f"--state-ahead must be >= 0, got {args.state_ahead}")
    with state_ahead(args.state_ahead):
        return _replay(parser, args)


def _replay(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """:func:`main` once its arguments are read."""
    if args.stream_up_fraction is not None and not 0 < args.stream_up_fraction <= 1:
        parser.error(f"--stream-up-fraction must be in (0, 1], got {args.stream_up_fraction}")
    if args.stream_host_charge is not None and not 0 <= args.stream_host_charge <= 1:
        parser.error(f"--stream-host-charge must be in [0, 1], got {args.stream_host_charge}")
    if args.speculative_step_cost_all is not None and not args.speculative_step_cost_all >= 1:
        parser.error(
            f"--speculative-step-cost-all must be >= 1, got {args.speculative_step_cost_all}"
        )
    if args.speculate is not None and not args.speculate >= 0:
        parser.error(f"--speculate takes G parameters >= 0, got {args.speculate}")
    if not args.speculative_step_cost >= 1:
        parser.error(f"--speculative-step-cost must be >= 1, got {args.speculative_step_cost}")
    costs: dict[str, float] = {}
    for item in args.host_step_cost:
        kind_name, _, value = item.partition("=")
        try:
            costs[kind_name] = float(value)
        except ValueError:
            parser.error(f"--host-step-cost takes KIND=COST, got {item!r}")
        if not costs[kind_name] > 0:
            parser.error(f"--host-step-cost {item!r}: the cost must be > 0")
    if costs and not (args.fused_gparam and args.fused_gparam > 0):
        parser.error("--host-step-cost needs --fused-gparam > 0")
    factor = args.backward_issue_factor
    if factor is not None and not 1 <= factor < math.inf:
        parser.error(f"--backward-issue-factor must be a finite factor >= 1, got {factor}")
    if not args.host_margin >= 1:
        parser.error(f"--host-margin must be >= 1, got {args.host_margin}")
    if args.stream_slots is not None and (args.stream_slots < 2 or args.stage_in_backward == "no"):
        parser.error("--stream-slots takes N >= 2 and stages (not with --stage-in-backward no)")

    import torch

    from offload_optim import (
        BackwardIssueCheck,
        planned_host_busy_s,
        streamed_step_costs,
        with_stage_in_backward,
    )
    from offload_optim.streamed import STREAM_SLOTS, resident_down_bytes

    slots = STREAM_SLOTS if args.stream_slots is None else args.stream_slots
    from offload_runtime.api import device_conversion_profile
    from offload_solver import ModelProfile, ParamPlacement, StreamedStepCosts, solve

    traced: dict[tuple[str, bool], ModelProfile] = {}
    print(
        "| file | workload | kind | measured step | predicted then | replayed now | "
        "measured peak | predicted then | replayed now | "
        "offloaded / host-state regions (measured plan; replayed) | "
        "mean step over the run: replayed now | host busy per step: in the loop; replayed | "
        "host idle after its last step until backward, and from there to its first step: "
        "measured; replayed | regions stepped under backward: measured; replayed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    worst_run = 0.0
    run_errors: dict[str, list[float]] = {}
    """Replayed step over run mean, less 1, per workload."""
    for path in args.json:
        document = json.loads(path.read_text())
        if not isinstance(document, dict) or "results" not in document:
            print(f"{path.name}: not offload_bench.py --json output, skipped", file=sys.stderr)
            continue
        results: dict[str, dict[str, dict[str, Any]]] = document["results"]
        for workload, rows in results.items():
            budget_gib = WORKLOADS[workload][3]
            for kind, row in rows.items():
                base_kind = kind.removesuffix("_stream")
                if base_kind not in REPLAYED or not row.get("ok") or "profile" not in row:
                    continue
                if args.streamed_only and not (
                    kind.endswith("_stream") and row.get("stream_from") == "plan"
                ):
                    continue
                if f"{path.name}:{kind}" in args.exclude:
                    print(f"| {path.name} | {workload} | {kind} | excluded | | | | | | | | | | |")
                    continue
                fuse = args.fuse_gelu or bool(row.get("fuse_gelu"))
                if (workload, fuse) not in traced:
                    traced[workload, fuse] = workload_profile(workload, fuse_gelu=fuse)
                p = row["profile"]
                rate = args.fused_gparam / costs[kind] if kind in costs else p["host_adam_gparam"]
                rate = host_rate(
                    row, rate, "recorded" if args.host_rate == "loop" else args.host_rate
                )
                rate /= args.host_margin
                base = traced[workload, fuse]
                variant = device_conversion_profile(base) if row["convert_on_device"] else base
                speculate = base_kind in SPECULATING
                simulation = row_simulation(row, speculate)
                if speculate and args.speculative_step_cost_all is not None:
                    simulation["speculative_step_cost"] = args.speculative_step_cost_all
                if args.speculate is not None:
                    simulation["host_step_after_backward"] = False
                    simulation["speculative_params"] = int(args.speculate * 1e9)
                    if not speculate:
                        simulation["speculative_step_cost"] = args.speculative_step_cost
                # Recorded from session 17 on; earlier rows were planned without it.
                in_use = int(row.get("device_bytes_in_use", args.in_use_mib * 2**20))
                if replays_streamed(kind, streamed=args.streamed, unstreamed=args.unstreamed):
                    # What the row's optimizer streams (a row forced by
                    # BENCH_STREAM_FRACTION was not planned so: replayed as planned).
                    # The costs the row's plan recorded; session 22's rows predate that
                    # and used 16 M-element chunks whatever the budget.
                    # --stream-ring budget: the ring sized as the bench sizes it now.
                    recorded = row.get("plan_streamed")
                    moments = torch.bfloat16 if "bf16m" in base_kind else torch.float32
                    # Written on the device as the row's optimizer did (from session 38
                    # on, unless BENCH_STREAM_WRITE=0), uploaded again before.
                    write = bool(recorded and recorded.get("resident_down_bytes_per_param"))
                    if args.write_resident != "recorded":
                        write = args.write_resident == "yes"
                    if args.stream_ring == "budget" or args.stream_slots is not None:
                        simulation["streamed"] = streamed_step_costs(
                            moments,
                            base_kind in FP16_IO,
                            budget_bytes=budget_gib * GiB,
                            write_resident=write,
                            stage_in_backward=True,
                            slots=slots,
                        )
                    elif recorded:
                        simulation["streamed"] = dataclasses.replace(
                            StreamedStepCosts(**recorded),
                            resident_down_bytes_per_param=(
                                resident_down_bytes(moments) if write else None
                            ),
                        )
                    else:
                        simulation["streamed"] = streamed_step_costs(
                            moments,
                            base_kind in FP16_IO,
                            chunk_numel=16 << 20,
                            write_resident=False,
                        )
                    stage = bool(row.get("stage_in_backward", False))
                    if args.stage_in_backward != "recorded":
                        stage = args.stage_in_backward == "yes"
                    simulation["streamed"] = with_stage_in_backward(
                        simulation["streamed"], moments, base_kind in FP16_IO, stage, slots=slots
                    )
                planning = {
                    **simulation,
                    "solver": "asyn",
                    "device_bytes_in_use": in_use,
                    # Rows before session 51 were planned without it.
                    "late_host_work": bool(row.get("late_host_work", False))
                    if args.late_host_work == "recorded"
                    else args.late_host_work == "yes",
                }
                hw_args = {
                    "op_overhead_us": row_issue_cost_us(row, args.op_overhead_us),
                    "stream_up": args.stream_up_fraction,
                    "stream_charge": args.stream_host_charge,
                    "backward_issue": args.backward_issue_factor,
                    "compute_model": args,
                }
                # --hold-plan: the plan is made with the row's own profile and simulated
                # with the overrides (hw); otherwise both use them.
                plan_args = {"compute_model": args} if args.hold_plan else hw_args
                hw = row_hardware(row, rate, **hw_args)
                plan = solve(
                    variant, row_hardware(row, rate, **plan_args), budget_gib * GiB, **planning
                )
                busy_in_loop = loop_busy_ms(row)
                if args.host_rate == "loop" and busy_in_loop:
                    rate *= planned_host_busy_s(plan) * 1e3 / busy_in_loop
                    hw = row_hardware(row, rate, **hw_args)
                    plan = solve(
                        variant, row_hardware(row, rate, **plan_args), budget_gib * GiB, **planning
                    )
                measured = row["step_ms"]
                # The plan's repeating step on hw: under --hold-plan the replayed step, and
                # where the host waits in it (simulated_host_cycle, below). ``simulation``:
                # the keyword arguments the plan was solved with that shape the step
                # (host_step_after_backward, speculative_step_cost, ...).
                steady = steady_run(variant, hw, plan, **simulation)
                replayed = (steady.period_s if args.hold_plan else plan.predicted_step_time_s) * 1e3
                worst = max(worst, abs(replayed - measured) / measured)
                offloaded = sum(rp.placement is not ParamPlacement.RESIDENT for rp in plan.regions)
                host = sum(rp.state.value != "device" for rp in plan.regions)
                streamed = sum(rp.state.value == "streamed" for rp in plan.regions)
                peak = row["peak_alloc_gib"]
                peak_now = plan.predicted_peak_bytes / GiB
                # The mean of every timed step (rows from session 18 on keep the steps): our
                # host steps run on into the next step, so the 5 fastest understate the
                # time per step that the simulator predicts for a run.
                steps = row.get("steps_ms")
                run = row.get("step_mean_ms", statistics.mean(steps) if steps else None)
                run_cell = "-"
                if run is not None:
                    worst_run = max(worst_run, abs(replayed - run) / run)
                    run_errors.setdefault(workload, []).append(replayed / run - 1)
                    run_cell = f"{run:.0f} ms: {_error(replayed, run)}"
                # The host worker's busy time: measured (loop_busy_ms, what --host-rate loop
                # scales by) and simulated (the cold step's host lane).
                busy_now = planned_host_busy_s(plan)
                in_loop = loop_busy_ms(row)
                busy_cell = (
                    f"{'-' if in_loop is None else f'{in_loop:.0f}'}; {busy_now * 1e3:.0f} ms"
                )
                # Where the host waits: measured by the row, and in the replayed plan's
                # repeating step (simulated_host_cycle).
                sim_delay, sim_tail, sim_under = simulated_host_cycle(steady)
                waits = measured_host_cycle(row)
                waits_cell = (
                    "-" if waits is None else f"{waits[1]:.0f} / {waits[0]:.0f}"
                ) + f"; {sim_tail * 1e3:.0f} / {sim_delay * 1e3:.0f} ms"
                under_cell = (
                    f"{row.get('speculated_regions', '-')}; {sim_under}" if speculate else "-"
                )
                print(
                    f"| {path.name} | {workload} | {kind} | {measured:.0f} ms | "
                    f"{row['pred_step_ms']:.0f} ({_error(row['pred_step_ms'], measured)}) | "
                    f"{replayed:.0f} ({_error(replayed, measured)}) | {peak:.2f} GiB | "
                    f"{row['pred_peak_gib']:.2f} ({_error(row['pred_peak_gib'], peak)}) | "
                    f"{peak_now:.2f} ({_error(peak_now, peak)}) | "
                    f"{row['offloaded_regions']} / {row['host_state_regions']}; "
                    f"{offloaded} / {host}{f' ({streamed} streamed)' if streamed else ''} | "
                    f"{run_cell} | {busy_cell} | {waits_cell} | "
                    f"{under_cell} |",
                    flush=True,
                )
                # The passes' spans: the host's wall time in the row's calls (from session
                # 55 on) beside the replayed step's compute lane.
                cpu = row.get("cpu_span_ms")
                if cpu:
                    sim = simulated_pass_spans(steady)
                    # What offload_optim.check_backward_issue reads from the loop: the
                    # factor at which issuing the traced operations takes that span.
                    factor = ""
                    if hw.op_overhead_s > 0 and host:
                        check = BackwardIssueCheck(
                            planned_factor=hw.backward_issue_factor,
                            operations=len(variant.operations),
                            op_overhead_s=hw.op_overhead_s,
                            measured_s=cpu["backward"] / 1e3,
                            steps=int(cpu.get("calls", 1)),
                        )
                        factor = (
                            f"; as a backward issue factor {check.loop_factor:.1f} "
                            f"({check.operations} operations at "
                            f"{check.op_overhead_s * 1e6:.1f} us)"
                        )
                    print(
                        f"    host span of backward(loss) {cpu['backward']:.1f} ms, forward "
                        f"{cpu['forward']:.1f} ms, step() {cpu['step']:.1f} ms; replayed "
                        f"backward {sim.get('bwd', 0.0) * 1e3:.1f} ms, forward "
                        f"{sim.get('fwd', 0.0) * 1e3:.1f} ms{factor}",
                        flush=True,
                    )
                if args.placements:
                    print(f"    placements: {placements_line(plan)}", flush=True)
                for changes in args.restate:
                    print(
                        f"    {restate_line(variant, hw, plan, changes, **simulation)}", flush=True
                    )
                if args.lanes is not None:
                    for lane, what, region, a, b in lane_window(steady, args.lanes / 1e3):
                        print(
                            f"    {lane} {what} r{region}: {a * 1e3:.1f}-{b * 1e3:.1f} ms",
                            flush=True,
                        )
                    busy_by = ", ".join(
                        f"{lane} {what} {busy * 1e3:.1f} ms ({n})"
                        for (lane, what), (n, busy) in sorted(lane_busy(steady).items())
                    )
                    print(
                        f"    the repeating step ({steady.period_s * 1e3:.1f} ms) busy: {busy_by}",
                        flush=True,
                    )
    print(f"largest replayed step error: {worst * 100:.1f}%")
    print(f"largest replayed error against the mean step over the run: {worst_run * 100:.1f}%")
    every = [e for errors in run_errors.values() for e in errors]
    if every:
        print(run_error_line(f"{len(every)} rows", every))
    if len(run_errors) > 1:
        for workload, errors in sorted(run_errors.items()):
            print(run_error_line(f"{len(errors)} {workload} rows", errors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
