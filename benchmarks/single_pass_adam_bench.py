"""Would a single-pass host Adam make exact fp16 speculation cheap? A measurement.

fp16 training may step no region before it knows that no gradient overflowed, so the host
step can hide under backward only if it is undone exactly on overflow (BENCHMARKS.md,
sessions 11-13). An exact undo needs the pre-step state. With torch's fused CPU Adam,
which works in place, that state must be copied first, and the speculative step
(``offload_optim.kernels.speculative_adam_``) cost 2.45x the plain step per parameter on
the H200 host. A kernel that reads the old state and writes the new state elsewhere in
the same pass moves about as many bytes as the in-place step. This script times, over
``--numel`` fp32 parameters with fp32 moments (AdamW, torch's CPU fused-kernel formula):

- ``torch_fused``: ``torch._fused_adamw_`` in place (what the optimizer runs today);
- ``torch_speculative``: ``speculative_adam_`` (master backup and spare moments by copies);
- ``single_in_place``: one compiled pass, in place;
- ``single_backup``: one pass that writes the master in place, its backup, and the next
  moments into spare buffers (the undo restores the master from the backup);
- ``single_ping_pong``: one pass that writes master and moments into spare buffers (the
  commit swaps them; needs the runtime to upload from whichever master is current).

The compiled kernels need numba (not a dependency of the packages):
``pip install numba``. Rates are medians of ``--repeats`` steps, in Gparam/s; the
single-pass variants are also checked against each other bit for bit and against torch's
kernel within rounding.

    python benchmarks/single_pass_adam_bench.py --numel 64e6 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LR, BETA1, BETA2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01
BLOCK = 1 << 16  # elements per parallel work item


def _kernels() -> dict[str, Callable[..., None]]:
    import numba
    import numpy as np

    # torch's CPU fused AdamW: decay, lerp the first moment, then the update, in fp32.
    # Each kernel loops over slices of one block, written out in full: numba's loop then
    # vectorizes (AVX sqrt and divide), which it did not with a shared inlined helper
    # returning a tuple, nor with the default (Python) error model for the division.
    @numba.njit(parallel=True, error_model="numpy")
    def in_place(p: Any, g: Any, m: Any, v: Any, c: Any) -> None:
        decay, omb1, b2, omb2, step_size, bc2s, eps = c[0], c[1], c[2], c[3], c[4], c[5], c[6]
        n = p.shape[0]
        for blk in numba.prange((n + BLOCK - 1) // BLOCK):
            s = blk * BLOCK
            e = min(n, s + BLOCK)
            ps, gs, ms, vs = p[s:e], g[s:e], m[s:e], v[s:e]
            for i in range(e - s):
                gi = gs[i]
                mi = ms[i] + omb1 * (gi - ms[i])
                vi = b2 * vs[i] + omb2 * gi * gi
                ps[i] = ps[i] * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                ms[i] = mi
                vs[i] = vi

    @numba.njit(parallel=True, error_model="numpy")
    def backup(p: Any, g: Any, m: Any, v: Any, bak: Any, m2: Any, v2: Any, c: Any) -> None:
        decay, omb1, b2, omb2, step_size, bc2s, eps = c[0], c[1], c[2], c[3], c[4], c[5], c[6]
        n = p.shape[0]
        for blk in numba.prange((n + BLOCK - 1) // BLOCK):
            s = blk * BLOCK
            e = min(n, s + BLOCK)
            ps, gs, ms, vs = p[s:e], g[s:e], m[s:e], v[s:e]
            bs, ms2, vs2 = bak[s:e], m2[s:e], v2[s:e]
            for i in range(e - s):
                gi = gs[i]
                pi = ps[i]
                mi = ms[i] + omb1 * (gi - ms[i])
                vi = b2 * vs[i] + omb2 * gi * gi
                bs[i] = pi
                ps[i] = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                ms2[i] = mi
                vs2[i] = vi

    @numba.njit(parallel=True, error_model="numpy")
    def ping_pong(p: Any, g: Any, m: Any, v: Any, p2: Any, m2: Any, v2: Any, c: Any) -> None:
        decay, omb1, b2, omb2, step_size, bc2s, eps = c[0], c[1], c[2], c[3], c[4], c[5], c[6]
        n = p.shape[0]
        for blk in numba.prange((n + BLOCK - 1) // BLOCK):
            s = blk * BLOCK
            e = min(n, s + BLOCK)
            ps, gs, ms, vs = p[s:e], g[s:e], m[s:e], v[s:e]
            ps2, ms2, vs2 = p2[s:e], m2[s:e], v2[s:e]
            for i in range(e - s):
                gi = gs[i]
                mi = ms[i] + omb1 * (gi - ms[i])
                vi = b2 * vs[i] + omb2 * gi * gi
                ps2[i] = ps[i] * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                ms2[i] = mi
                vs2[i] = vi

    return {"in_place": in_place, "backup": backup, "ping_pong": ping_pong}


def _consts(step: int) -> tuple[float, ...]:
    import math

    bc1 = 1 - BETA1**step
    bc2 = 1 - BETA2**step
    return (1 - LR * WD, 1 - BETA1, BETA2, 1 - BETA2, LR / bc1, math.sqrt(bc2), EPS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=float, default=64e6, help="parameters")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    n = int(args.numel)
    if n < 1 or args.repeats < 1:
        parser.error("need --numel >= 1 and --repeats >= 1")

    try:
        import numba
        import numpy as np
    except ImportError:
        print("numba is not installed: pip install numba", file=sys.stderr)
        return 2
    import torch

    from offload_optim.kernels import AdamHyper, fused_adam_, speculative_adam_

    threads = torch.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)

    def state() -> list[torch.Tensor]:
        p = torch.randn(n, generator=gen) * 0.02
        g = torch.randn(n, generator=gen) * 1e-3
        m = torch.randn(n, generator=gen) * 1e-4
        v = torch.rand(n, generator=gen) * 1e-6
        return [p, g, m, v]

    base = state()
    spare = [torch.empty(n) for _ in range(3)]
    hyper = AdamHyper(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, adamw=True)
    kernels = _kernels()
    arr = [t.numpy() for t in base]
    sp = [t.numpy() for t in spare]

    # Correctness first (one step from the same state): compiles the kernels too.
    step_t = torch.tensor(1.0)
    ref = [t.clone() for t in base]
    fused_adam_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [step_t], hyper)
    c1 = np.array(_consts(1), dtype=np.float32)  # fp32, as torch's kernel computes
    outs: dict[str, list[np.ndarray[Any, Any]]] = {}
    work = [a.copy() for a in arr]
    kernels["in_place"](*work, c1)
    outs["in_place"] = [work[0], work[2], work[3]]
    work = [a.copy() for a in arr]
    bak, m2, v2 = (np.empty_like(arr[0]) for _ in range(3))
    kernels["backup"](*work, bak, m2, v2, c1)
    assert np.array_equal(bak, arr[0]), "backup holds the pre-step master"
    outs["backup"] = [work[0], m2, v2]
    p2, m2, v2 = (np.empty_like(arr[0]) for _ in range(3))
    kernels["ping_pong"](*[a.copy() for a in arr], p2, m2, v2, c1)
    outs["ping_pong"] = [p2, m2, v2]
    identical = all(
        np.array_equal(a, b)
        for name in ("backup", "ping_pong")
        for a, b in zip(outs["in_place"], outs[name], strict=True)
    )
    p_ref = ref[0].numpy()
    rel = float(np.max(np.abs(outs["in_place"][0] - p_ref)) / np.max(np.abs(p_ref - arr[0])))
    print(
        f"{n / 1e6:.0f} M params, {threads} threads: single-pass variants bit-identical to "
        f"each other: {identical}; largest master difference to torch's kernel: "
        f"{rel:.2e} of the largest update",
        file=sys.stderr,
    )

    def timed(fn: Callable[[int], None]) -> float:
        fn(1)  # touches every page of every buffer it writes
        samples = []
        for k in range(2, args.repeats + 2):
            t0 = time.perf_counter()
            fn(k)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    p, g, m, v = base
    bak_t, mn, vn = spare

    def torch_fused(k: int) -> None:
        fused_adam_([p], [g], [m], [v], [torch.tensor(float(k))], hyper)

    def torch_spec(k: int) -> None:
        speculative_adam_(p, g, m, v, mn, vn, bak_t, torch.tensor(float(k)), hyper)

    def single_in_place(k: int) -> None:
        kernels["in_place"](*arr, np.array(_consts(k), dtype=np.float32))

    def single_backup(k: int) -> None:
        kernels["backup"](*arr, *sp, np.array(_consts(k), dtype=np.float32))

    pp = [arr, [sp[0], arr[1], sp[1], sp[2]]]

    def single_ping_pong(k: int) -> None:
        src, dst = pp[k % 2], pp[(k + 1) % 2]
        kernels["ping_pong"](*src, dst[0], dst[2], dst[3], np.array(_consts(k), dtype=np.float32))

    rows: list[dict[str, Any]] = []
    for name, fn in (
        ("torch_fused", torch_fused),
        ("torch_speculative", torch_spec),
        ("single_in_place", single_in_place),
        ("single_backup", single_backup),
        ("single_ping_pong", single_ping_pong),
    ):
        s = timed(fn)
        rows.append({"kernel": name, "median_ms": s * 1e3, "gparam_per_s": n / s / 1e9})
    plain = rows[0]["median_ms"]
    for row in rows:
        row["x_torch_fused"] = row["median_ms"] / plain
        print(json.dumps(row))
    if args.json:
        out = {"numel": n, "threads": threads, "bit_identical": identical, "rows": rows}
        out["max_master_diff_of_update"] = rel
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
