"""When each streamed region was published against when its issue ended, from a trace.

    python benchmarks/publish_lag.py TRACE.json.gz

For a ``torch.profiler`` trace of ``offload_bench.py --profile-dir``: every
``streamed step N (issue)`` span (the issuing thread's, or the host worker's) paired with
the next ``streamed step N (publish)`` span, printing the issue's end, the publish and the
time between them (ms, from the trace's first event, as ``copy_lag.py`` prints them).
Each publish also names the latest issue end before it and the end of the last host step
(``host step N``, not the hooks') before it. A publish that follows the last issue end
at once while its own issue ended long before, with the host steps already over, is a
region that landed and waited for the issuing thread ([Note: publishing while issuing]
in offload_optim/streamed.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from copy_lag import load, start_us

STREAMED = re.compile(r"streamed step (\d+) \((issue|publish)\)$")
HOST_STEP = re.compile(r"host step \d+$")


def publish_lags(
    events: list[dict[str, Any]], t0: float
) -> list[tuple[int, float, float, float, float | None]]:
    """(region, issue end, publish start, latest issue end before it, last host step end
    before it) in ms from ``t0``, per publish whose region's issue is in the trace, in
    publish order."""
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"),
        key=lambda e: float(e["ts"]),
    )
    issued: dict[int, float] = {}
    issue_ends: list[float] = []
    host_ends: list[float] = []
    out: list[tuple[int, float, float, float, float | None]] = []
    for e in spans:
        start = (float(e["ts"]) - t0) / 1e3
        end = start + float(e.get("dur", 0.0)) / 1e3
        name = str(e["name"])
        if HOST_STEP.match(name):
            host_ends.append(end)
            continue
        m = STREAMED.match(name)
        if m is None:
            continue
        r = int(m.group(1))
        if m.group(2) == "issue":
            issued[r] = end
            issue_ends.append(end)
        elif r in issued:
            at = issued.pop(r)
            latest = max(x for x in issue_ends if x <= start)
            host = max((x for x in host_ends if x <= start), default=None)
            out.append((r, at, start, latest, host))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a torch.profiler trace (.json or .json.gz)")
    args = parser.parse_args(argv)
    events = load(args.trace)
    rows = publish_lags(events, start_us(events))
    if not rows:
        print("no streamed region was issued and published in this trace")
        return 1
    print(
        "region | issue ended | published | after its issue | latest issue end | last host step end"
    )
    for r, at, pub, latest, host in rows:
        host_s = "-" if host is None else f"{host:.1f}"
        print(f"{r} | {at:.1f} | {pub:.1f} | {pub - at:.1f} | {latest:.1f} | {host_s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
