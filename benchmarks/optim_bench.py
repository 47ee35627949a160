"""Host (and device) Adam step throughput of HybridAdam, fp32 against bf16 moments.

    export PYTHONPATH=$(ls -d packages/*/src | tr '\n' :)
    python benchmarks/optim_bench.py --numel 64M

For each configuration it times ``HybridAdam.step`` over fp32 parameters of ``--numel``
elements in total (split into ``--tensors`` flat tensors, as regions are) on the CPU, and
prints parameters per second. Host Adam is bound by memory bandwidth on a many-core host
(fp32 moments stream about 28 bytes per parameter, bf16 moments about 20), and by compute
on a host with few cores. ``--chunks`` sweeps the chunk size of the bf16-moment route
(see [Note: bf16 moments] in offload_optim/kernels.py). With CUDA present it also times
fused CUDA Adam over the same number of parameters.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from offload_optim import HybridAdam, kernels


def parse_count(text: str) -> int:
    """'64M' -> 64 * 2**20; '1G' -> 2**30; plain integers pass through."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    if text[-1].upper() in units:
        return int(float(text[:-1]) * units[text[-1].upper()])
    return int(text)


def time_step(numel: int, tensors: int, device: str, moments: torch.dtype, repeats: int) -> float:
    """Best wall time (s) of one HybridAdam step over ``numel`` fp32 parameters."""
    size = numel // tensors
    params = [torch.zeros(size, device=device) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(size, device=device)
    opt = HybridAdam(params, lr=1e-3, weight_decay=0.01, moments_dtype=moments)
    best = float("inf")
    for i in range(repeats + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step touches the moments' pages for the first time
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=parse_count, default=parse_count("64M"))
    parser.add_argument("--tensors", type=int, default=8, help="flat tensors (regions)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--chunks",
        default="256K,1M,4M",
        help="chunk sizes of the bf16-moment route to sweep (comma separated)",
    )
    parser.add_argument("--conversions", action="store_true", help="also time dtype copies")
    args = parser.parse_args()
    print(
        f"host: {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{args.numel / 1e6:.0f} M parameters in {args.tensors} tensors"
    )
    print(f"{'device':>6} {'moments':>8} {'chunk':>8} {'ms/step':>9} {'Gparam/s':>9}")
    rows: list[tuple[str, str, str, float]] = []
    t = time_step(args.numel, args.tensors, "cpu", torch.float32, args.repeats)
    rows.append(("cpu", "fp32", "-", t))
    for chunk in args.chunks.split(","):
        kernels.CHUNK_NUMEL = parse_count(chunk)
        t = time_step(args.numel, args.tensors, "cpu", torch.bfloat16, args.repeats)
        rows.append(("cpu", "bf16", chunk, t))
    if torch.cuda.is_available():
        t = time_step(args.numel, args.tensors, "cuda", torch.float32, args.repeats)
        rows.append(("cuda", "fp32", "-", t))
    if args.conversions:
        # What the bf16 route adds per chunk: widening and narrowing copies of moments.
        n = args.numel
        b16 = torch.zeros(n, dtype=torch.bfloat16)
        f32 = torch.zeros(n)
        ops: tuple[tuple[str, Callable[[], torch.Tensor]], ...] = (
            ("widen bf16->fp32", lambda: f32.copy_(b16)),
            ("narrow fp32->bf16", lambda: b16.copy_(f32)),
            # The runtime's host gradient accumulation: zero, then add the staged gradient.
            ("zero fp32", lambda: f32.zero_()),
            ("add bf16 into fp32", lambda: f32.add_(b16)),
            ("add fp32 into fp32", lambda: f32.add_(f32)),
        )
        for name, fn in ops:
            fn()
            start = time.perf_counter()
            fn()
            t = time.perf_counter() - start
            print(f"{name:>18}: {t * 1e3:7.1f} ms = {n / t / 1e9:6.2f} Gelem/s")
    for device, moments, chunk, t in rows:
        print(f"{device:>6} {moments:>8} {chunk:>8} {t * 1e3:9.1f} {args.numel / t / 1e9:9.3f}")


if __name__ == "__main__":
    main()
