"""Two kinds' step-time ratio over several rounds of one run, and its median (CPU only).

    python benchmarks/pair_ratios.py W1 ours full_gpu gpu_out/W1_*.json

Each JSON file is one ``offload_bench.py --json`` output holding both kinds of the
workload (one round: ``gpu_session.sh w1x`` alternates the two kinds round after round).
Prints, per file, both kinds' step (mean of the 5 fastest timed steps) and run mean (ms)
and their ratios, then the median ratio over the rounds, which is what a row of a
launch-bound workload is judged by: the machine's per-operation cost drifts by more than
the difference being measured from one minute to the next (W1 in session 26: 57 against
34 ms, then 39 against 43, for the same two programs on one machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import FULL_GPU_KINDS


def round_ratio(
    data: dict[str, Any], workload: str, a: str, b: str
) -> tuple[float, float, float, float] | None:
    """(a step, b step, a run mean, b run mean) in ms, or None if either row failed."""
    rows = data["results"].get(workload, {})
    ra, rb = rows.get(a), rows.get(b)
    if not (ra and rb and ra.get("ok") and rb.get("ok")):
        return None
    return ra["step_ms"], rb["step_ms"], ra["step_mean_ms"], rb["step_mean_ms"]


def report(paths: list[Path], workload: str, a: str, b: str) -> list[str]:
    """The lines this script prints."""
    lines = []
    fast, run, in_turn = [], [], []
    for path in paths:
        data = json.loads(path.read_text())
        paired = data["results"].get(workload, {}).get(a, {}).get("paired_full_gpu")
        # The paired training's recipe: "fp16" (full_gpu) before session 40 recorded one.
        recipe = paired.get("recipe", "fp16") if isinstance(paired, dict) else None
        if recipe is not None and FULL_GPU_KINDS.get(b) == recipe and "ratio" in paired:
            # BENCH_PAIR_FULL_GPU: the two stepped in turn in a's process.
            in_turn.append(paired["ratio"])
            lines.append(
                f"{path.name}, in turn ({paired['pairs']} pairs): {a} "
                f"{paired['ours_step_ms']:.1f} ms, {b} {paired['peer_step_ms']:.1f} ms: "
                f"{paired['ratio']:.3f}x (run {paired['run_ratio']:.3f}x, "
                f"median pair {paired['pair_ratio_median']:.3f}x)"
            )
        got = round_ratio(data, workload, a, b)
        if got is None:
            lines.append(f"{path.name}: {a} or {b} missing or failed")
            continue
        sa, sb, ma, mb = got
        fast.append(sa / sb)
        run.append(ma / mb)
        lines.append(
            f"{path.name}: {a} {sa:.1f} ms (run {ma:.1f}), {b} {sb:.1f} ms (run {mb:.1f}): "
            f"{sa / sb:.3f}x (run {ma / mb:.3f}x)"
        )
    if fast:
        lines.append(
            f"median over {len(fast)} rounds: {statistics.median(fast):.3f}x "
            f"(run {statistics.median(run):.3f}x); range {min(fast):.3f}-{max(fast):.3f}x"
        )
    if in_turn:
        lines.append(
            f"in turn, median over {len(in_turn)} rounds: {statistics.median(in_turn):.3f}x; "
            f"range {min(in_turn):.3f}-{max(in_turn):.3f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload")
    parser.add_argument("kind_a")
    parser.add_argument("kind_b")
    parser.add_argument("json", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print("\n".join(report(args.json, args.workload, args.kind_a, args.kind_b)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
