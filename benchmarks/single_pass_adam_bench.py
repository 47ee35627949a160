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
- ``single_fp16_io``: one pass that reads an fp16 gradient and also writes the fp16
  upload copy of the new master (the fp16-across-PCIe lead, BENCHMARKS.md session 14);
  ``single_fp16_unfused``: the same work as three passes (widen, in-place step, narrow),
  which is what host conversion does today;
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


def _fp16_io() -> Callable[..., None]:
    """A single pass that reads fp16 gradients and writes the fp16 upload copy of the new
    master as well (the fp16-across-PCIe lead of BENCHMARKS.md session 14): the in-place
    kernel's arithmetic (offload_optim/_numba_adam.py ``in_place``, repeated statement for
    statement), with the gradient decoded from its fp16 bits and the new master encoded
    into fp16 bits with round-to-nearest-even, NaN as 0x7E00 (numba has no float16 type).
    The gradient is divided by the scale but not written back."""
    import numba
    import numpy as np

    @numba.njit(parallel=True, error_model="numpy")
    def fp16_io(p: Any, pb: Any, g16: Any, m: Any, v: Any, p16: Any, c: Any) -> None:
        decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
        step_size, bc2s, eps, scale = c[5], c[6], c[7], c[8]
        n = p.shape[0]
        for blk in numba.prange((n + BLOCK - 1) // BLOCK):
            s = blk * BLOCK
            e = min(n, s + BLOCK)
            k = e - s
            ps, pbs, hs, ms, vs, outs = p[s:e], pb[s:e], g16[s:e], m[s:e], v[s:e], p16[s:e]
            bits = np.empty(2 * k, np.uint32)
            wide = bits.view(np.float32)
            # fp16 bits to fp32 bits: normals rebias the exponent, inf/NaN keep all ones;
            # subnormals and zeros are made in the float loop below.
            for j in range(k):
                h = np.int64(hs[j])
                sign = (h & 0x8000) << 16
                mag = h & 0x7FFF
                if mag >= 0x7C00:
                    out = sign | 0x7F800000 | ((mag & 0x3FF) << 13)
                else:
                    out = sign | ((mag << 13) + 0x38000000)
                bits[j] = np.uint32(out)
            for j in range(k):
                h = np.int64(hs[j])
                raw = wide[j]
                if (h & 0x7C00) == 0:
                    sub = np.float32(h & 0x3FF) * np.float32(5.9604645e-08)  # 2**-24
                    raw = -sub if (h & 0x8000) != 0 else sub
                gi = raw / scale
                pi = ps[j]
                gi = gi + l2 * pi
                mi = ms[j] + omb1 * (gi - ms[j])
                vi = b2 * vs[j] + omb2 * gi * gi
                pn = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                ps[j] = pn
                ms[j] = mi
                vs[j] = vi
                wide[k + j] = np.abs(pn) + np.float32(0.5)  # for the subnormal encoding
            # fp32 bits to fp16 bits, round to nearest even.
            for j in range(k):
                f = np.int64(pbs[j])
                sign = (f >> 16) & 0x8000
                a = f & 0x7FFFFFFF
                if a >= 0x47800000:  # too large for fp16, inf or NaN
                    out = np.int64(0x7E00 if a > 0x7F800000 else 0x7C00)
                elif a < 0x38800000:  # fp16 subnormal or zero: 0.5 + |x| rounds it
                    out = np.int64(bits[k + j]) - 0x3F000000
                else:
                    out = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
                outs[j] = np.uint16(out | sign)

    return fp16_io


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
    # fp16 in, fp16 out: the in-place kernel's result from the widened fp16 gradient, and
    # torch's fp16 rounding of the new master. The gradient includes fp16 subnormals,
    # zeros of both signs and values near 65504.
    fp16_io = _fp16_io()
    g16 = (torch.randn(n, generator=gen) * 1e-3).half()
    g16[: min(n, 8)] = torch.tensor([0.0, -0.0, 6e-8, -3e-6, 6e-5, 65504.0, -1.0, 2.0])[
        : min(n, 8)
    ].half()
    io = [t.clone() for t in base]
    p16_io = torch.empty(n, dtype=torch.float16)

    def bits16(t: torch.Tensor) -> Any:
        return single_pass._flat(t, "an fp16 tensor", torch.float16)

    scale = torch.tensor(4.0)
    io_consts = single_pass._constants(hyper, 1.0, scale)
    fp16_io(
        io[0].numpy(),
        io[0].numpy().view("uint32"),
        bits16(g16),
        io[2].numpy(),
        io[3].numpy(),
        bits16(p16_io),
        io_consts,
    )
    wid = [t.clone() for t in base]
    wid[1] = g16.float()
    single_pass.adam_(wid[0], wid[1], wid[2], wid[3], one, hyper, grad_scale=scale)
    fp16_identical = (
        torch.equal(io[0], wid[0])
        and torch.equal(io[2], wid[2])
        and torch.equal(io[3], wid[3])
        and torch.equal(p16_io.view(torch.int16), wid[0].half().view(torch.int16))
    )
    # The encoder alone, on values around fp16's edges (subnormals, ties, overflow, NaN),
    # as masters that a zero-rate step leaves unchanged (an infinite master would not be:
    # 0 * inf is NaN in the L2 term).
    edge = torch.tensor(
        [
            0.0,
            -0.0,
            1e-8,
            2.98e-8,
            2.9802322e-08,
            6.1e-5,
            -6.1035156e-05,
            65504.0,
            65519.0,
            65520.0,
            1e6,
            3e38,
            -3e38,
            float("nan"),
            1.0009766,
            1.0004883,
            -1.0014648,
        ],
        dtype=torch.float32,
    )
    ones = torch.zeros(edge.numel(), dtype=torch.float16)  # zero gradient: the master
    e_p, e_m, e_v = edge.clone(), torch.zeros_like(edge), torch.zeros_like(edge)
    keep = single_pass._constants(
        AdamHyper(lr=0.0, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0, adamw=True),
        1.0,
        None,
    )
    e16 = torch.empty(edge.numel(), dtype=torch.float16)
    fp16_io(
        e_p.numpy(),
        e_p.numpy().view("uint32"),
        bits16(ones),
        e_m.numpy(),
        e_v.numpy(),
        bits16(e16),
        keep,
    )
    encode_identical = torch.equal(e16.view(torch.int16), edge.half().view(torch.int16))
    print(
        f"fp16-in/fp16-out kernel bit-identical to the in-place kernel on the widened "
        f"gradient and to torch's fp16 rounding: {fp16_identical}; encoder on edge values: "
        f"{encode_identical}",
        file=sys.stderr,
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

    g16_t, p16_t = (torch.randn(n, generator=gen) * 1e-3).half(), torch.empty(n).half()
    g16_np, p16_np = bits16(g16_t), bits16(p16_t)
    p_np, pb_np, m_np, v_np = p.numpy(), p.numpy().view("uint32"), m.numpy(), v.numpy()

    def single_fp16_io(k: int) -> None:
        c = single_pass._constants(hyper, float(k), scale)
        fp16_io(p_np, pb_np, g16_np, m_np, v_np, p16_np, c)

    def single_fp16_io_f16c(k: int) -> None:
        # The package's kernel (HybridAdam(fp16_io=True)): the CPU's half conversions.
        single_pass.adam_fp16_io_(p, g16_t, m, v, p16_t, step_t(k), hyper, scale)

    g_wide = torch.empty(n)

    def single_fp16_unfused(k: int) -> None:
        # What host conversion does today: widen, step, publish, as three passes.
        g_wide.copy_(g16_t)
        single_pass.adam_(p, g_wide, m, v, step_t(k), hyper, grad_scale=scale)
        p16_t.copy_(p)

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
        ("single_fp16_io", single_fp16_io),
        ("single_fp16_io_f16c", single_fp16_io_f16c),
        ("single_fp16_unfused", single_fp16_unfused),
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
        out["fp16_io_bit_identical"] = fp16_identical and encode_identical
        out["max_master_diff_of_update"] = rel
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
