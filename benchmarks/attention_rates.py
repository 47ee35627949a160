"""Fused attention's forward and backward rates at each workload's own attention shape.

    python benchmarks/attention_rates.py --workloads W3,W4 --json attention_rates.json

For each workload of ``offload_bench.py``, traces its model on the meta device (nothing
is allocated), reads the shape of its attention operations' inputs from the graph
(``[batch, heads, seq, head_dim]``: the example zoo's GPT-2 XL has 32 heads of 50) and
their dropout, and runs ``offload_runtime.measure_attention_at`` at that shape on
``--device`` (fp16 on CUDA, fp32 on the CPU). Prints one line per workload and
writes the rates (FLOP/s) to ``--json``: the ``--attention-fwd`` / ``--attention-bwd`` of
``compute_fidelity.py`` and ``replay_bench.py`` are these over 1e12.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_runtime import AttentionShape, attention_shapes, measure_attention_at


def attention_shape(workload: str) -> AttentionShape:
    """The shape of ``workload``'s first attention operation, from its traced graph
    (``offload_runtime.attention_shapes``, which ``memory_optimize(measure_attention=True)``
    measures at)."""
    from replay_bench import workload_traced

    shapes = attention_shapes(workload_traced(workload).graph_module)
    if not shapes:
        raise SystemExit(f"{workload}: no attention operation in the traced graph")
    return shapes[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="W3,W4", help="comma-separated, as offload_bench")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--json", type=Path, default=None, help="write the rates here")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for workload in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        shape = attention_shape(workload)
        fwd, bwd = measure_attention_at(args.device, shape, reps=args.reps)
        out[workload] = {**asdict(shape), "fwd_flop_per_s": fwd, "bwd_flop_per_s": bwd}
        print(
            f"{workload}: attention {shape.batch} x {shape.heads} x {shape.seq} x "
            f"{shape.head_dim}, dropout {shape.dropout_p:g} on {args.device}: forward "
            f"{fwd / 1e12:.3g} TFLOP/s, backward {bwd / 1e12:.3g} TFLOP/s",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
