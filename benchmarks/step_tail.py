"""What follows backward in a profiled step, and the main thread's issuing time (CPU only).

    python benchmarks/step_tail.py benchmarks/results/s25c3_trace_W1_ours.json.gz

Reads a ``torch.profiler`` trace that ``offload_bench.py`` kept (``prof_NAME/trace_*``;
two steps) and prints, for each ``AMPOptimizer.step`` in it, times in ms from the moment
``step()`` began on the host:

- when the device's last kernel or copy before it ended (negative: the device was idle
  when the step began, so the step was bound by issuing, as W1's is);
- how long ``step()`` took on the host, and when it read the step's answer (its first
  ``cudaStreamSynchronize``);
- the device's busy time from then on, and when its last kernel or copy ended: the
  step's tail, up to the end of the step's work on the device (the work that starts
  before the main thread's next operator, the next forward's first).

It also prints the main thread's busy time, its top-level operator spans (``cpu_op``:
the forward, and ``step()``'s own) summed over the trace, and the device's (kernels,
copies and memsets, summed). Two traces of the same
workload, from two machines, set side by side show how much longer issuing took on one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_trace import load_trace, union_us

STEP = "Optimizer.step#AMPOptimizer.step"
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def summarise(trace: dict[str, Any]) -> list[str]:
    """The lines this script prints for ``trace``."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted(
        (e for e in events if e["name"] == STEP and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    if not steps:
        raise SystemExit(f"no {STEP} span in the trace: was it profiled with AMPOptimizer?")
    device = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: e["ts"])
    main = steps[0]["tid"]
    spans = [e for e in events if e["tid"] == main and e.get("cat") == "cpu_op"]
    main_ops = sorted(e["ts"] for e in spans)
    lines = []
    for i, step in enumerate(steps, start=1):
        t0 = step["ts"]
        # The step's device work: what starts before the main thread's next operator
        # after step() (the next forward's first), which cannot launch anything earlier.
        stop = next((t for t in main_ops if t > t0 + step["dur"]), float("inf"))
        before = [e["ts"] + e["dur"] for e in device if e["ts"] < t0]
        after = [e for e in device if t0 <= e["ts"] < stop]
        syncs = [
            e["ts"]
            for e in events
            if e["name"] == "cudaStreamSynchronize" and t0 <= e["ts"] <= t0 + step["dur"]
        ]
        idle = f"{(max(before) - t0) / 1e3:+.2f} ms" if before else "-"
        answer = f"{(min(syncs) - t0) / 1e3:.2f} ms" if syncs else "-"
        busy = sum(e["dur"] for e in after) / 1e3
        end = f"{(max(e['ts'] + e['dur'] for e in after) - t0) / 1e3:.2f} ms" if after else "-"
        lines.append(
            f"step {i}: device's last work before it ended at {idle}; host step "
            f"{step['dur'] / 1e3:.2f} ms (answer read at {answer}); device busy "
            f"{busy:.2f} ms after it, done at {end}"
        )
    lines.append(
        f"main thread (tid {main}, {len(spans)} operator spans): top-level operators busy "
        f"{union_us([(e['ts'], e['ts'] + e['dur']) for e in spans]) / 1e3:.1f} ms over the "
        f"trace's {len(steps)} steps"
    )
    lines.append(
        f"device: kernels and copies busy {sum(e['dur'] for e in device) / 1e3:.1f} ms over "
        f"the trace's {len(steps)} steps"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path, nargs="+")
    args = parser.parse_args(argv)
    for path in args.trace:
        print(path)
        for line in summarise(load_trace(path)):
            print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
