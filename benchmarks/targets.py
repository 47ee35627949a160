"""The issue's targets, met or missed, and the report's results table, from one run's rows.

    python benchmarks/targets.py benchmarks/results/summary.json
    python benchmarks/targets.py --table benchmarks/results/summary.json
    python benchmarks/targets.py bench_out                  # an offload_bench.py --out folder

Reads the rows of one run - an ``offload_bench.py`` summary file, or output folders of
its row files - from one machine, and prints the targets as a markdown table (one line a
target: each row's figure and whether the target is met), or with ``--table`` the rows
themselves, as BENCHMARKS.md's results table. Nothing is allocated; no GPU is needed.

The targets judge the libraries' defaults (kind ``ours``, and the rungs of the host-state
ladder beside torchao: ``ours_bf16_rn`` at torchao's numerics, ``ours_bf16_sr`` with
stochastic rounding), or the kinds ``--kind`` names; the budget and prediction targets
judge every row of ours that the workload's report runs (``offload_bench.REPORT_KINDS``).
Step times are the mean of each row's 5 fastest timed steps, the run mean's ratio beside
it in brackets.
A ratio sets a row of ours against the median of the peer's rows of the same workload.
The targets:

- every peak allocated of ours within its workload's budget;
- each predicted peak within 5% of the measured, each predicted step within 15% of the
  run mean;
- at each workload, the defaults within 3% of the fastest configuration of the same
  numerics that ran (``OursConfig.speed_only``: the planner's candidates forced, streaming
  off);
- W1 at most 1.05x full-GPU training (``full_gpu_master``), and, where a row of ours
  stepped full-GPU training in turn (``offload_bench.py --pair-full-gpu``), by those
  steps too;
- W2 to W5 with fp32 optimizer state at most 1.15x the floor
  (:func:`offload_bench.issue_floor`), and W3 to W5 at most 0.5x FSDP2 CPU offload's step;
- W3, W4 and W5 at torchao's numerics (``ours_bf16_rn``) at most 0.75x torchao's
  ``CPUOffloadOptimizer`` step, and with stochastic rounding (``ours_bf16_sr``) at most
  0.85x;
- W6 (activations beyond the budget): every row of ours within its budget and its
  predicted peak within 5% of the measured; the defaults at most 0.8x the faster of the
  checkpointing FSDP2 arms (``fsdp2_ckpt``, ``fsdp2_ckpt_host``: their median steps), and
  at most 1.1x full-GPU training with every block checkpointed (``full_gpu_ckpt``) where
  that row ran and trained (at W6a, if it fit).

A ratio target is "met" when every row meets it, "met by the median" when the median row
does, else "missed" with the median's distance from it. Full-GPU rows whose loss did not
fall (:func:`offload_bench.trained`) are no reference, and a last line says whether each
trained.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ckpt_peers import FSDP2_ARMS, FULL_GPU_CKPT
from offload_bench import (
    FULL_GPU,
    OURS,
    REPORT_KINDS,
    WORKLOADS,
    issue_floor,
    read_rows,
    sorted_rows,
    trained,
)

Row = dict[str, Any]
JUDGED = ("ours", "ours_bf16_rn", "ours_bf16_sr")
"""The kinds the peer and floor targets judge: the defaults, and the two bf16-master rungs
set beside torchao."""
AGAINST_TORCHAO = {"ours_bf16_rn": 0.75, "ours_bf16_sr": 0.85}
"""Each rung's bound on its step over torchao's, at W3, W4 and W5."""
FASTEST_WITHIN = 1.03
"""The defaults' bound against the fastest configuration of the same numerics."""
W6 = ("W6a", "W6b")
"""The workloads bound by activations."""
FULL_GPU_KINDS = (FULL_GPU, FULL_GPU_CKPT)
"""The full-GPU peers: no reference where their loss did not fall."""
W6_FSDP2_WITHIN = 0.8
"""W6's bound on the defaults' step over the faster checkpointing FSDP2 arm's."""
W6_FULL_GPU_WITHIN = 1.1
"""W6's bound on the defaults' step over checkpointed full-GPU training's."""


@dataclass(frozen=True)
class Verdict:
    """One target: each row's figure, and whether it is met."""

    target: str
    cells: list[str]
    status: str


class Run:
    """One run's rows, with what the targets set them against."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = list(rows)
        self.ok = [r for r in self.rows if r.get("ok")]
        reads = [float(r["host_fused_gparam"]) for r in self.ok if r.get("host_fused_gparam")]
        self.host_gparam = statistics.median(reads) if reads else None
        """Torch's fused host Adam rate as the run's processes read it (Gparam/s; the
        median over its rows), for the floor's host Adam part where it beats the
        profile's."""

    def of(self, workload: str, kind: str) -> list[Row]:
        """The rows of ``kind`` at ``workload`` that ran; of full GPU, those that trained."""
        rows = [r for r in self.ok if r["workload"] == workload and r["kind"] == kind]
        if kind in FULL_GPU_KINDS:
            rows = [r for r in rows if trained(r) is not False]
        return rows

    def ours(self, kinds: set[str] | None = None) -> list[Row]:
        """The rows of ours that ran, of ``kinds`` where given, else of the kinds their
        workload's report runs (``offload_bench.REPORT_KINDS``); never the ablation."""
        return [
            r
            for r in self.ok
            if r["kind"] in OURS
            and not OURS[r["kind"]].reference
            and r["kind"] in (REPORT_KINDS.get(r["workload"], ()) if kinds is None else kinds)
        ]

    def judged(self, kinds: set[str] | None = None) -> list[Row]:
        """The rows the peer and floor targets judge: of ``kinds`` where given, else the
        defaults' (:data:`JUDGED`)."""
        return [r for r in self.ours(kinds) if kinds is not None or r["kind"] in JUDGED]

    def of_kind(self, kind: str) -> list[Row]:
        """The rows of ``kind`` that ran, at every workload."""
        return [r for r in self.ok if r["kind"] == kind]

    def peer(self, workload: str, kind: str) -> tuple[float, float] | None:
        """The median step and run mean of ``kind``'s rows at ``workload``."""
        rows = self.of(workload, kind)
        if not rows:
            return None
        return (
            statistics.median(r["step_ms"] for r in rows),
            statistics.median(r["step_mean_ms"] for r in rows),
        )

    def fastest_peer(self, workload: str, kinds: Sequence[str]) -> str | None:
        """Of ``kinds``, the one whose median step at ``workload`` is the fastest (None
        where none ran)."""
        ran = [(peer[0], k) for k in kinds if (peer := self.peer(workload, k)) is not None]
        return min(ran)[1] if ran else None

    def compute_ms(self, workload: str) -> float | None:
        """Full-GPU training's forward and backward at ``workload`` (the median over its
        rows that trained): the floor's compute part."""
        rows = [r for r in self.of(workload, FULL_GPU) if r.get("fwd_bwd_ms")]
        return statistics.median(r["fwd_bwd_ms"] for r in rows) if rows else None

    def floor(self, row: Row) -> tuple[float, str] | None:
        return issue_floor(row, self.compute_ms(row["workload"]), self.host_gparam)


def error(predicted: float, measured: float) -> float:
    """``predicted``'s error against ``measured``, a fraction (nan where nothing was
    measured: a row run on the CPU records no device peak)."""
    return predicted / measured - 1 if measured else math.nan


def label(row: Row) -> str:
    return f"{row['workload']} {row['kind']}"


def fp32_state(row: Row) -> bool:
    return OURS[row["kind"]].host_state == "fp32"


Ratio = tuple[Row, float, float]
"""A row of ours, its ratio by the 5 fastest steps and by the run means."""


def ratio_verdict(target: str, limit: float, ratios: list[Ratio], strict: bool) -> Verdict:
    """``target`` met when each ratio is within ``limit`` (below it, with ``strict``)."""
    if not ratios:
        return Verdict(target, ["no rows"], "not measured")

    def ok(x: float) -> bool:
        return x < limit if strict else x <= limit

    cells = [f"{label(row)}: {r:.3f}x (run {run:.3f}x)" for row, r, run in ratios]
    values = [r for _, r, _ in ratios]
    median = statistics.median(values)
    if all(ok(v) for v in values):
        status = "met"
    elif ok(median):
        status = f"met by the median ({median:.3f}x; {sum(map(ok, values))} of {len(values)} rows)"
    else:
        status = f"missed: median {median:.3f}x, {100 * (median / limit - 1):.1f}% over {limit}x"
    return Verdict(target, cells, status)


def bound_verdict(target: str, checks: list[tuple[str, str, bool]]) -> Verdict:
    """``target`` met when every check (row label, figure, holds) holds."""
    if not checks:
        return Verdict(target, ["no rows"], "not measured")
    cells = [f"{name}: {figure}" for name, figure, _ in checks]
    failed = sum(not holds for _, _, holds in checks)
    return Verdict(target, cells, "met" if not failed else f"missed by {failed} of {len(checks)}")


def fastest_verdict(run: Run) -> Verdict:
    """The defaults (``ours``) against the fastest row of the same numerics at their
    workload (``OursConfig.speed_only``: the defaults' own row counts, so a workload where
    only the defaults ran is at 1.000x), by the 5 fastest steps; the run means' ratio, to
    the fastest run mean, in brackets."""
    ratios: list[Ratio] = []
    ends: list[str] = []
    for row in run.of_kind("ours"):
        same = [
            r
            for r in run.ok
            if r["workload"] == row["workload"] and r["kind"] in OURS and OURS[r["kind"]].speed_only
        ]
        best = min(same, key=lambda r: r["step_ms"])
        best_mean = min(r["step_mean_ms"] for r in same)
        ratios.append((row, row["step_ms"] / best["step_ms"], row["step_mean_ms"] / best_mean))
        ends.append(f" of {best['kind']} {best['step_ms']:.1f} ms ({len(same)} configurations)")
    target = f"defaults within {100 * (FASTEST_WITHIN - 1):.0f}% of the fastest configuration"
    verdict = ratio_verdict(target, FASTEST_WITHIN, ratios, False)
    if not ratios:
        return verdict
    return Verdict(
        verdict.target, [c + e for c, e in zip(verdict.cells, ends, strict=True)], verdict.status
    )


def against(run: Run, kind: str, rows: list[Row]) -> list[Ratio]:
    """Each row's ratios to the median of ``kind``'s rows at its workload."""
    out = []
    for row in rows:
        peer = run.peer(row["workload"], kind)
        if peer is not None:
            out.append((row, row["step_ms"] / peer[0], row["step_mean_ms"] / peer[1]))
    return out


def verdicts(rows: Sequence[Row], kinds: set[str] | None = None) -> list[Verdict]:
    """Every target over one run's ``rows`` (of ours, those of ``kinds`` where given, else
    of the report's kinds)."""
    run = Run(rows)
    every = run.ours(kinds)
    ours = run.judged(kinds)
    out = peak_verdicts("", every)
    pred_step = []
    for r in every:
        err = error(r["pred_step_ms"], r["step_mean_ms"])
        pred_step.append((label(r), f"{100 * err:+.1f}%", abs(err) <= 0.15))
    out.append(bound_verdict("predicted step within 15% of the run mean", pred_step))
    out.append(fastest_verdict(run))

    w1 = [r for r in ours if r["workload"] == "W1"]
    out.append(ratio_verdict("W1 <= 1.05x full GPU", 1.05, against(run, FULL_GPU, w1), False))
    paired = [
        (r, p["ratio"], p["run_ratio"])
        for r in w1
        if isinstance(p := r.get("paired_full_gpu"), dict) and "ratio" in p
    ]
    if paired:
        out.append(ratio_verdict("W1 <= 1.05x full GPU, stepped in turn", 1.05, paired, False))
    for w in ("W2", "W3", "W4", "W5"):
        fp32 = [r for r in ours if r["workload"] == w and fp32_state(r)]
        floors: list[Ratio] = []
        ends: list[str] = []
        for r in fp32:
            found = run.floor(r)
            if found is not None:
                floors.append((r, r["step_ms"] / found[0], r["step_mean_ms"] / found[0]))
                ends.append(f" of {found[1]} {found[0]:.1f} ms")
        verdict = ratio_verdict(f"{w} fp32 state <= 1.15x floor", 1.15, floors, False)
        if floors:
            verdict = Verdict(
                verdict.target,
                [c + e for c, e in zip(verdict.cells, ends, strict=True)],
                verdict.status,
            )
            if run.compute_ms(w) is None:
                verdict.cells.append("no full-GPU row: the floor lacks its compute part")
        out.append(verdict)
        if w != "W2":
            out.append(
                ratio_verdict(
                    f"{w} fp32 state <= 0.5x FSDP2", 0.5, against(run, "fsdp2", fp32), False
                )
            )
    for w in ("W3", "W4", "W5"):
        for kind, bound in AGAINST_TORCHAO.items():
            rungs = [r for r in ours if r["workload"] == w and r["kind"] == kind]
            out.append(
                ratio_verdict(
                    f"{w} {kind} <= {bound}x torchao",
                    bound,
                    against(run, "torchao", rungs),
                    False,
                )
            )
    out += w6_verdicts(run, every, ours)
    full = [r for r in run.ok if r["kind"] in FULL_GPU_KINDS and trained(r) is not None]
    if full:
        out.append(
            bound_verdict(
                "full-GPU rows trained (loss fell, finite)",
                [
                    (
                        label(r),
                        f"loss {r['loss_before']:.3f} -> {r['loss_after']:.3f}",
                        bool(trained(r)),
                    )
                    for r in full
                ],
            )
        )
    return out


def peak_verdicts(prefix: str, rows: Sequence[Row]) -> list[Verdict]:
    """``rows``' peaks within their budgets and their predicted peaks within 5% of them,
    the targets' names led by ``prefix``."""
    within, predicted = [], []
    for r in rows:
        peak, budget = r["peak_alloc_gib"], r["budget_gib"]
        within.append((label(r), f"{peak:.2f} / {budget:g} GiB", peak <= budget))
        err = error(r["pred_peak_gib"], peak)
        predicted.append((label(r), f"{100 * err:+.1f}%", abs(err) <= 0.05))
    return [
        bound_verdict(f"{prefix}peak allocated <= budget", within),
        bound_verdict(f"{prefix}predicted peak within 5%", predicted),
    ]


def w6_verdicts(run: Run, every: list[Row], ours: list[Row]) -> list[Verdict]:
    """W6's targets: the budget and the predicted peak over ``every`` W6 row of ours, and
    the defaults' rows (``ours``) against the faster checkpointing FSDP2 arm and, where it
    ran and trained, checkpointed full-GPU training."""
    out = peak_verdicts("W6 ", [r for r in every if r["workload"] in W6])
    for w in W6:
        rows = [r for r in ours if r["workload"] == w]
        arm = run.fastest_peer(w, FSDP2_ARMS)
        verdict = ratio_verdict(
            f"{w} <= {W6_FSDP2_WITHIN}x the faster FSDP2 checkpointing arm",
            W6_FSDP2_WITHIN,
            [] if arm is None else against(run, arm, rows),
            False,
        )
        if arm is not None and rows:
            verdict.cells.append(f"the faster arm: {arm}")
        out.append(verdict)
        if w == "W6a" or run.of(w, FULL_GPU_CKPT):
            out.append(
                ratio_verdict(
                    f"{w} <= {W6_FULL_GPU_WITHIN}x {FULL_GPU_CKPT}",
                    W6_FULL_GPU_WITHIN,
                    against(run, FULL_GPU_CKPT, rows),
                    False,
                )
            )
    return out


def targets_markdown(results: Sequence[Verdict]) -> str:
    lines = ["| target | rows | status |", "|---|---|---|"]
    for v in results:
        lines.append(f"| {v.target} | {'<br>'.join(v.cells)} | {v.status} |")
    return "\n".join(lines) + "\n"


def _same(rows: Sequence[Row], key: str) -> str:
    values = sorted({str(r.get(key)) for r in rows})
    return values[0] if len(values) == 1 else " / ".join(values)


def _ratio_cell(run: Run, row: Row, kind: str) -> str:
    peer = run.peer(row["workload"], kind)
    if peer is None:
        return "-"
    return f"{row['step_ms'] / peer[0]:.3f}x ({row['step_mean_ms'] / peer[1]:.3f}x)"


def results_table(rows: Sequence[Row]) -> str:
    """The run's rows as BENCHMARKS.md's results table: each row's step (the mean of its 5
    fastest steps) and run mean, its peak against the budget, and for ours the predictions
    (off the run mean and the measured peak), the floor and the ratios to it and to each
    peer (by the 5 fastest, the run means' in brackets; at W6, the checkpointing peers:
    ``full_gpu_ckpt`` as full GPU, the faster checkpointing arm as FSDP2)."""
    run = Run(rows)
    ordered = sorted_rows(list(rows))
    lines = [
        f"Rows of {_same(rows, 'date')}, commit {_same(rows, 'commit')}, "
        f"{_same(rows, 'gpu')}, torch {_same(rows, 'torch')}. Commands:",
        "",
        *(f"    {c}" for c in sorted({str(r.get("command")) for r in rows})),
        "",
        "| workload | kind | step ms (run mean) | peak GiB / budget | predicted step "
        "(of run mean) | predicted peak (of peak) | floor ms (part) | / floor | / full GPU "
        "| / FSDP2 | / torchao |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ordered:
        name, batch, seq, _ = WORKLOADS[r["workload"]]
        head = f"| {r['workload']} {name} {batch}x{seq} | {r['kind']} "
        if not r.get("ok"):
            lines.append(head + f"| failed: {r.get('error', '?')} |" + " - |" * 8)
            continue
        cells = [
            f"{r['step_ms']:.1f} ({r['step_mean_ms']:.1f})",
            f"{r['peak_alloc_gib']:.2f} / {r['budget_gib']:g}",
        ]
        if r["kind"] in OURS:
            step_err = 100 * error(r["pred_step_ms"], r["step_mean_ms"])
            peak_err = 100 * error(r["pred_peak_gib"], r["peak_alloc_gib"])
            found = run.floor(r)
            # W6's peers are the checkpointing ones: its full-GPU row checkpoints, and
            # its FSDP2 column is the faster arm.
            w6 = r["workload"] in W6
            full = _ratio_cell(run, r, FULL_GPU_CKPT if w6 else FULL_GPU)
            arm = run.fastest_peer(r["workload"], FSDP2_ARMS) if w6 else "fsdp2"
            pair = r.get("paired_full_gpu")
            if isinstance(pair, dict) and "ratio" in pair:
                full += f"; in turn {pair['ratio']:.3f}x ({pair['run_ratio']:.3f}x)"
            cells += [
                f"{r['pred_step_ms']:.1f} ({step_err:+.1f}%)",
                f"{r['pred_peak_gib']:.2f} ({peak_err:+.1f}%)",
                "-" if found is None else f"{found[0]:.1f} ({found[1]})",
                "-"
                if found is None
                else f"{r['step_ms'] / found[0]:.3f}x ({r['step_mean_ms'] / found[0]:.3f}x)",
                full,
                "-" if arm is None else _ratio_cell(run, r, arm),
                _ratio_cell(run, r, "torchao"),
            ]
        else:
            cells += ["-"] * 7
        lines.append(head + "| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "paths", type=Path, nargs="+", help="a summary file, or offload_bench.py output folders"
    )
    parser.add_argument(
        "--table", action="store_true", help="print the results table instead of the targets"
    )
    parser.add_argument(
        "--kind",
        action="append",
        metavar="KIND",
        help="judge our rows of this kind (may be repeated); default: the kinds of each "
        "workload's report rows",
    )
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.paths if not p.exists()]
    if missing:
        parser.error(f"no such file or folder: {', '.join(missing)}")
    unknown = set(args.kind or ()) - set(OURS)
    if unknown:
        parser.error(f"unknown kind(s) {sorted(unknown)}; ours are {', '.join(OURS)}")
    try:
        rows = [row for path in args.paths for row in read_rows(path)]
    except ValueError as exc:
        parser.error(str(exc))
    if not rows:
        parser.error("no rows in these files")
    if args.table:
        print(results_table(rows), end="")
    else:
        print(targets_markdown(verdicts(rows, set(args.kind) if args.kind else None)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
