"""Host step throughput: the plain fused Adam step against the speculative (undoable) one.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' :)
    python packages/offload-optim/benchmarks/speculative_step_bench.py --numel 64M

For fp32 and bf16 moments it times, over one flat fp32 parameter of ``--numel`` elements on
the CPU, ``kernels.fused_adam_`` (what PARTIALS mode runs after backward) and
``kernels.speculative_adam_`` (what SPECULATIVE_UNDO runs under backward: per chunk a
master backup, moments copied or widened into the spare ones, the fused kernel, and the
overflow partial) for each chunk size of ``--chunks``, and prints parameters per second
and the ratio. Buffers are touched before timing, so page faults are not counted. The
speculative step hides under backward only when it is not much slower than the plain one:
see [Note: speculative steps] in offload_optim/hybrid_adam.py.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from offload_optim import kernels
from offload_optim.kernels import AdamHyper, fused_adam_, speculative_adam_


def parse_count(text: str) -> int:
    """'64M' -> 64 * 2**20; '1G' -> 2**30; plain integers pass through."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def best_s(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time (s) of ``fn`` over ``repeats`` runs after one untimed run."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compare(
    n: int, moments: torch.dtype, chunks: list[int], hyper: AdamHyper, repeats: int
) -> None:
    """Time and print both steps over ``n`` parameters with ``moments``."""
    scale = torch.tensor(1024.0)  # fp16 training divides by the loss scale
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n, dtype=moments), torch.zeros(n, dtype=moments)
    m_next, v_next, backup = torch.zeros_like(m), torch.zeros_like(v), torch.zeros_like(p)
    step = torch.tensor(1.0)

    def plain() -> None:
        fused_adam_([p], [g], [m], [v], [step], hyper, scale)

    def spec() -> None:
        speculative_adam_(p, g, m, v, m_next, v_next, backup, step, hyper, scale)

    plain_s = best_s(plain, repeats)
    name = str(moments).removeprefix("torch.")
    print(f"{name} moments: fused {n / plain_s / 1e9:.2f} Gparam/s ({plain_s * 1e3:.0f} ms)")
    for chunk in chunks:
        kernels.SPECULATE_CHUNK_NUMEL = chunk
        spec_s = best_s(spec, repeats)
        print(
            f"  speculative, chunk {chunk}: {n / spec_s / 1e9:.2f} Gparam/s "
            f"({spec_s * 1e3:.0f} ms) = {spec_s / plain_s:.2f}x the fused step"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=parse_count, default=parse_count("64M"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunks", default="256K,1M,4M", help="speculative chunk sizes")
    args = parser.parse_args()
    chunks = [parse_count(c) for c in args.chunks.split(",")]
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    print(f"{args.numel / 2**20:.0f} Mi parameters, {torch.get_num_threads()} threads")
    for moments in (torch.float32, torch.bfloat16):
        compare(args.numel, moments, chunks, hyper, args.repeats)


if __name__ == "__main__":
    main()
