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
  commit swaps them; needs the runtime to upload from whichever master is current);
- the same with bf16 moments: torch's chunked route (``fused_adam_``), and the
  single-pass in-place and backup kernels.

The compiled kernels need numba (``pip install 'offload-optim[single-pass]'``); the first
two are ``offload_optim.single_pass``'s. Rates are medians of ``--repeats`` steps, in Gparam/s; the
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


def _ping_pong() -> Callable[..., None]:
    """A single pass that writes master and moments into spare buffers (AdamW, no grad
    scale), for comparison with the package's in-place and backup kernels (whose
    arithmetic, in offload_optim/_numba_adam.py, it repeats)."""
    import numba
    import numpy as np

    @numba.njit(parallel=True, error_model="numpy")
    def ping_pong(p: Any, g: Any, m: Any, v: Any, p2: Any, m2: Any, v2: Any, c: Any) -> None:
        decay, omb1, b2, omb2, step_size, bc2s, eps = c[0], c[2], c[3], c[4], c[5], c[6], c[7]
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

    return ping_pong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=float, default=64e6, help="parameters")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    n = int(args.numel)
    if n < 1 or args.repeats < 1:
        parser.error("need --numel >= 1 and --repeats >= 1")

    import torch

    from offload_optim import single_pass
    from offload_optim.kernels import AdamHyper, fused_adam_, speculative_adam_

    if not single_pass.available():
        print("numba is not installed: pip install numba", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    p, g, m, v = (
        torch.randn(n, generator=gen) * 0.02,
        torch.randn(n, generator=gen) * 1e-3,
        torch.randn(n, generator=gen) * 1e-4,
        torch.rand(n, generator=gen) * 1e-6,
    )
    base = [p.clone(), g.clone(), m.clone(), v.clone()]
    bak, mn, vn, pn = (torch.empty(n) for _ in range(4))
    hyper = AdamHyper(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD, adamw=True)
    ping_pong = _ping_pong()

    def consts(k: int) -> Any:
        return single_pass._constants(hyper, float(k), None)

    # Correctness first (one step from the same state): compiles the kernels too.
    one = torch.tensor(1.0)
    ref = [t.clone() for t in base]
    fused_adam_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [one], hyper)
    plain = [t.clone() for t in base]
    single_pass.adam_(plain[0], plain[1], plain[2], plain[3], one, hyper)
    spec = [t.clone() for t in base]
    single_pass.speculative_adam_(spec[0], spec[1], spec[2], spec[3], mn, vn, bak, one, hyper)
    pp = [t.clone() for t in base]
    m_pp, v_pp = torch.empty(n), torch.empty(n)
    ping_pong(*(t.numpy() for t in pp), pn.numpy(), m_pp.numpy(), v_pp.numpy(), consts(1))
    identical = (
        torch.equal(spec[0], plain[0])
        and torch.equal(mn, plain[2])
        and torch.equal(vn, plain[3])
        and torch.equal(bak, base[0])
        and torch.equal(pn, plain[0])
        and torch.equal(m_pp, plain[2])
        and torch.equal(v_pp, plain[3])
    )
    update = (ref[0] - base[0]).abs().max()
    rel = float((plain[0] - ref[0]).abs().max() / update)
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

    def step_t(k: int) -> torch.Tensor:
        return torch.tensor(float(k))

    def torch_fused(k: int) -> None:
        fused_adam_([p], [g], [m], [v], [step_t(k)], hyper)

    def torch_spec(k: int) -> None:
        speculative_adam_(p, g, m, v, mn, vn, bak, step_t(k), hyper)

    def single_in_place(k: int) -> None:
        single_pass.adam_(p, g, m, v, step_t(k), hyper)

    def single_backup(k: int) -> None:
        single_pass.speculative_adam_(p, g, m, v, mn, vn, bak, step_t(k), hyper)

    sets = [[p, g, m, v], [pn, g, mn, vn]]

    def single_ping_pong(k: int) -> None:
        src, dst = sets[k % 2], sets[(k + 1) % 2]
        arrays = [t.numpy() for t in (*src, dst[0], dst[2], dst[3])]
        ping_pong(*arrays, consts(k))

    # bf16 moments: torch's chunked route against the single-pass kernels.
    mb, vb = m.bfloat16(), v.bfloat16()
    mnb, vnb = mb.clone(), vb.clone()

    def torch_bf16(k: int) -> None:
        fused_adam_([p], [g], [mb], [vb], [step_t(k)], hyper)

    def single_in_place_bf16(k: int) -> None:
        single_pass.adam_(p, g, mb, vb, step_t(k), hyper)

    def single_backup_bf16(k: int) -> None:
        single_pass.speculative_adam_(p, g, mb, vb, mnb, vnb, bak, step_t(k), hyper)

    rows: list[dict[str, Any]] = []
    for name, fn in (
        ("torch_fused", torch_fused),
        ("torch_speculative", torch_spec),
        ("single_in_place", single_in_place),
        ("single_backup", single_backup),
        ("single_ping_pong", single_ping_pong),
        ("torch_bf16_moments", torch_bf16),
        ("single_in_place_bf16_moments", single_in_place_bf16),
        ("single_backup_bf16_moments", single_backup_bf16),
    ):
        s = timed(fn)
        rows.append({"kernel": name, "median_ms": s * 1e3, "gparam_per_s": n / s / 1e9})
    first = rows[0]["median_ms"]
    for row in rows:
        row["x_torch_fused"] = row["median_ms"] / first
        print(json.dumps(row))
    if args.json:
        out = {"numel": n, "threads": threads, "bit_identical": identical, "rows": rows}
        out["max_master_diff_of_update"] = rel
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
