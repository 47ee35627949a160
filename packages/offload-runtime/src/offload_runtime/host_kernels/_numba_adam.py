"""The numba kernels behind :mod:`offload_runtime.host_kernels.single_pass` (imported only
when used).

See [Note: single-pass host Adam] in single_pass.py. ``c`` holds, in fp32: decay, l2,
1 - beta1, beta2, 1 - beta2, step size, sqrt(bias correction 2), eps, grad scale (1:
none), and whether to write the unscaled gradient back (0/1). The two kernels' arithmetic
must stay identical, statement for statement: a committed speculative step must equal the
plain step bit for bit. Every kernel releases the GIL (``nogil``): the host step runs on
the runtime's worker thread while the main thread issues the device's kernels, and a step
holding the GIL would stall that issue for the step's whole length. ``q`` holds the shared
block counter and the thread count ([Note: blocks claimed as threads free up]).
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped, import-not-found, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, import-not-found, unused-ignore]
from numba import types
from numba.core import cgutils  # type: ignore[import-untyped, import-not-found, unused-ignore]
from numba.extending import intrinsic  # type: ignore[import-untyped, import-not-found, unused-ignore]

BLOCK = 1 << 16
"""Elements per parallel work item (256 KiB of fp32 per array: a core's L2 holds a block
of every array a kernel touches). Defined here, not imported: numba's disk cache is
invalidated by changes to this file only, and a kernel compiles it in as a constant."""


CHUNK = 1 << 12
"""Elements a kernel that streams its output (see below) steps into its scratch before
writing them out (48 KiB for three fp32 arrays: the scratch stays in the core's L1/L2)."""

# Streaming stores. A speculative step writes the old master and the new moments into
# buffers it has not read, and an fp16-I/O step writes an offloaded region's fp16 upload
# copy; a plain store first reads each such cache line from memory (write-allocate): a
# speculative step moved 44 bytes per parameter against the in-place step's 28.
# Non-temporal stores skip that read. LLVM keeps a store non-temporal only when it can emit
# a vector store at the vector's alignment (numba tells it the element's), so the kernels
# step a chunk into a scratch in cache and _stream copies it out: a scalar head up to a
# 64-byte boundary, aligned 64-byte non-temporal vector stores, a scalar tail.
# Non-temporal stores are weakly ordered: _store_fence (a sequentially consistent fence:
# mfence on x86, which orders them) ends every block, before the parallel loop's join
# publishes it to other threads.
_LINE = 64
"""Bytes per non-temporal vector store (one cache line)."""


def _nt_store_line_typer(typingctx: Any, dst: Any, j: Any, src: Any, k: Any) -> Any:
    sig = types.void(dst, j, src, k)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        dty, _, sty, _ = signature.args
        d = context.make_array(dty)(context, builder, args[0])
        s = context.make_array(sty)(context, builder, args[2])
        item: Any = cgutils.get_item_pointer
        dp = item(context, builder, dty, d, [args[1]], wraparound=False)
        sp = item(context, builder, sty, s, [args[3]], wraparound=False)
        elem = context.get_data_type(dty.dtype)
        vec = ir.VectorType(elem, _LINE // context.get_abi_sizeof(elem))
        value = builder.load(builder.bitcast(sp, vec.as_pointer()), align=1)
        store = builder.store(value, builder.bitcast(dp, vec.as_pointer()), align=_LINE)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))
        return context.get_dummy_value()

    return sig, codegen


def _store_fence_typer(typingctx: Any) -> Any:
    sig = types.void()

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


_nt_store_line: Any = intrinsic(_nt_store_line_typer)
"""``dst[j:j+L] = src[k:k+L]``, ``L`` elements filling 64 bytes, non-temporally; ``dst[j]``
64-byte aligned; ``src`` of ``dst``'s type."""
_store_fence: Any = intrinsic(_store_fence_typer)


def _claim_typer(typingctx: Any, q: Any) -> Any:
    sig = types.int64(q)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (qty,) = signature.args
        a = context.make_array(qty)(context, builder, args[0])
        item: Any = cgutils.get_item_pointer
        counter = item(context, builder, qty, a, [ir.Constant(ir.IntType(64), 0)])
        one = ir.Constant(ir.IntType(64), 1)
        return builder.atomic_rmw("add", counter, one, "monotonic")

    return sig, codegen


_claim: Any = intrinsic(_claim_typer)
"""``q[0] += 1`` atomically, returning the old ``q[0]``: the block that the calling thread
claims (see [Note: blocks claimed as threads free up])."""

# [Note: blocks claimed as threads free up]
# Each kernel's parallel loop runs one item per thread (q[1] threads), and each thread
# claims the next block from a shared counter (q[0]) until none is left, instead of a
# prange over the blocks (numba's schedulers split that into one equal share a thread,
# fixed up front). With fixed shares the step ends with its slowest thread: one thread
# that loses its core to another one (backward's issuing thread, a copy's OpenMP pool)
# holds back the whole step. Claiming one block (256 KiB an array) at a time, the other
# threads take over a delayed thread's share. A block's arithmetic does not depend on
# which thread steps it, so results do not depend on the claims (measured: BENCHMARKS.md,
# Decisions, "Host Adam threads claim blocks").


@numba.njit(inline="always")  # type: ignore[untyped-decorator, unused-ignore]
def _stream(dst: Any, s: Any, src: Any, k: Any) -> None:
    """``dst[s:s+k] = src[:k]``, the aligned middle with non-temporal stores."""
    size = dst.itemsize
    lanes = _LINE // size
    head = 0
    misaligned = (dst.ctypes.data + s * size) % _LINE
    if misaligned != 0:
        head = min(k, (_LINE - misaligned) // size)
    for i in range(head):
        dst[s + i] = src[i]
    i = head
    while i + lanes <= k:
        _nt_store_line(dst, s + i, src, i)
        i += lanes
    while i < k:
        dst[s + i] = src[i]
        i += 1


# Moments in fp32 or bf16. bf16 is stored as its bits (uint16: numpy has no bf16), and
# each kernel below compiles once per moment type: _wide widens a moment element to fp32
# (exact: the bits shifted up) and _moment narrows the stepped value back to the moments'
# type with round-to-nearest-even, as torch's bf16 conversion does (a NaN becomes 0x7FC0,
# as in torch's scalar conversion; its vector one gives 0xFFFF: a NaN either way); for
# fp32 moments both are the identity. They are LLVM integer operations on the element, so
# the loop vectorizes as it does for fp32 (widening a block into an fp32 scratch and
# narrowing it back in separate loops, with a branch per NaN check, does not; it steps
# bf16 moments slower than fp32 ones).


def _wide_typer(typingctx: Any, x: Any) -> Any:
    if x == types.float32:
        sig = types.float32(types.float32)

        def same(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return args[0]

        return sig, same
    if x == types.uint16:
        sig = types.float32(types.uint16)

        def widen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i32 = ir.IntType(32)
            bits = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(bits, ir.FloatType())

        return sig, widen
    return None


def _moment_typer(typingctx: Any, x: Any, like: Any) -> Any:
    if x != types.float32:
        return None
    if like == types.float32:
        sig = types.float32(types.float32, types.float32)

        def same(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return args[0]

        return sig, same
    if like == types.uint16:
        sig = types.uint16(types.float32, types.uint16)

        def narrow(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return bf16_nearest_ir(builder, builder.bitcast(args[0], ir.IntType(32)))

        return sig, narrow
    return None


def bf16_nearest_ir(builder: Any, bits: Any) -> Any:
    """LLVM IR: :func:`bf16_bits_ir` rounding to nearest even."""
    i32 = ir.IntType(32)
    odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    return bf16_bits_ir(builder, bits, builder.add(ir.Constant(i32, 0x7FFF), odd))


def bf16_bits_ir(builder: Any, bits: Any, addend: Any) -> Any:
    """LLVM IR: the bf16 bits (i16) of the fp32 value whose bits are ``bits`` (i32), rounded
    by adding ``addend`` (i32, below 2**16) to the bits and dropping the low 16. ``0x7FFF``
    plus the lowest kept bit rounds to nearest even; a uniform random addend rounds
    stochastically (low_precision.py). Both carry into the exponent as they should: past
    the largest bf16 value into inf, never from inf into a NaN; a NaN becomes 0x7FC0."""
    i32 = ir.IntType(32)
    rounded = builder.lshr(builder.add(bits, addend), ir.Constant(i32, 16))
    magnitude = builder.and_(bits, ir.Constant(i32, 0x7FFFFFFF))
    nan = builder.icmp_unsigned(">", magnitude, ir.Constant(i32, 0x7F800000))
    out = builder.select(nan, ir.Constant(i32, 0x7FC0), rounded)
    return builder.trunc(out, ir.IntType(16))


_wide: Any = intrinsic(_wide_typer)
_moment: Any = intrinsic(_moment_typer)


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def in_place(p: Any, g: Any, m: Any, v: Any, c: Any, q: Any) -> None:
    decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
    step_size, bc2s, eps, scale, write_g = c[5], c[6], c[7], c[8], c[9]
    n = p.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    for _ in numba.prange(q[1]):
        while True:
            blk = _claim(q)
            if blk >= nb:
                break
            s = blk * BLOCK
            e = min(n, s + BLOCK)
            ps, gs, ms, vs = p[s:e], g[s:e], m[s:e], v[s:e]
            for i in range(e - s):
                gi = gs[i] / scale
                if write_g != 0:
                    gs[i] = gi
                pi = ps[i]
                gi = gi + l2 * pi
                m0 = _wide(ms[i])
                mi = m0 + omb1 * (gi - m0)
                vi = b2 * _wide(vs[i]) + omb2 * gi * gi
                ps[i] = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                ms[i] = _moment(mi, ms[i])
                vs[i] = _moment(vi, vs[i])


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def speculative(
    p: Any, g: Any, m: Any, v: Any, bak: Any, m2: Any, v2: Any, bad: Any, c: Any, q: Any
) -> None:
    decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
    step_size, bc2s, eps, scale, write_g = c[5], c[6], c[7], c[8], c[9]
    n = p.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    for _ in numba.prange(q[1]):
        tb = np.empty(CHUNK, np.float32)
        tm = np.empty(CHUNK, m.dtype)
        tv = np.empty(CHUNK, v.dtype)
        while True:
            blk = _claim(q)
            if blk >= nb:
                break
            flag = 0
            for s in range(blk * BLOCK, min(n, (blk + 1) * BLOCK), CHUNK):
                e = min(n, s + CHUNK)
                ps, gs, ms, vs = p[s:e], g[s:e], m[s:e], v[s:e]
                for i in range(e - s):
                    raw = gs[i]
                    flag |= (raw - raw) != 0  # inf - inf and nan - nan are nan
                    gi = raw / scale
                    if write_g != 0:
                        gs[i] = gi
                    pi = ps[i]
                    tb[i] = pi
                    gi = gi + l2 * pi
                    m0 = _wide(ms[i])
                    mi = m0 + omb1 * (gi - m0)
                    vi = b2 * _wide(vs[i]) + omb2 * gi * gi
                    ps[i] = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                    tm[i] = _moment(mi, ms[i])
                    tv[i] = _moment(vi, vs[i])
                _stream(bak, s, tb, e - s)
                _stream(m2, s, tm, e - s)
                _stream(v2, s, tv, e - s)
            _store_fence()
            bad[blk] = flag


# fp16 gradients in, fp16 upload copy out (the plan's fp16 I/O): the gradient is read
# as fp16 bits and widened, and the new master is narrowed into the training-dtype copy
# that the runtime uploads, in the same pass. numba has no float16 type; these two
# intrinsics emit LLVM's half conversions, which x86 CPUs with F16C run as vcvtph2ps /
# vcvtps2ph (round to nearest even, as torch's .half()), vectorized with the loop. On a
# CPU without them LLVM calls a runtime helper that the JIT may not link:
# single_pass.fp16_io_available() compiles and checks them once before they are used.


def _widen16_typer(typingctx: Any, bits: Any) -> Any:
    sig = types.float32(types.uint16)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def _narrow16_typer(typingctx: Any, x: Any) -> Any:
    sig = types.uint16(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


_widen16: Any = intrinsic(_widen16_typer)
_narrow16: Any = intrinsic(_narrow16_typer)


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def convert16(src: Any, wide: Any, narrow: Any, to_wide: Any) -> None:
    """fp16 bits to fp32 (``to_wide``) or fp32 to fp16 bits, with the kernels'
    conversions: what ``single_pass.fp16_io_available`` checks against torch."""
    if to_wide:
        for i in numba.prange(src.shape[0]):
            wide[i] = _widen16(src[i])
    else:
        for i in numba.prange(wide.shape[0]):
            narrow[i] = _narrow16(wide[i])


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def in_place_fp16_io(p: Any, g16: Any, m: Any, v: Any, p16: Any, c: Any, q: Any) -> None:
    decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
    step_size, bc2s, eps, scale = c[5], c[6], c[7], c[8]
    n = p.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    for _ in numba.prange(q[1]):
        t16 = np.empty(CHUNK, np.uint16)
        while True:
            blk = _claim(q)
            if blk >= nb:
                break
            for s in range(blk * BLOCK, min(n, (blk + 1) * BLOCK), CHUNK):
                e = min(n, s + CHUNK)
                ps, hs, ms, vs = p[s:e], g16[s:e], m[s:e], v[s:e]
                for i in range(e - s):
                    gi = _widen16(hs[i]) / scale
                    pi = ps[i]
                    gi = gi + l2 * pi
                    m0 = _wide(ms[i])
                    mi = m0 + omb1 * (gi - m0)
                    vi = b2 * _wide(vs[i]) + omb2 * gi * gi
                    pn = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                    ps[i] = pn
                    ms[i] = _moment(mi, ms[i])
                    vs[i] = _moment(vi, vs[i])
                    t16[i] = _narrow16(pn)
                # p16 may be g16 itself: the chunk's gradient has been read.
                _stream(p16, s, t16, e - s)
            _store_fence()


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def speculative_fp16_io(
    p: Any, g16: Any, m: Any, v: Any, bak: Any, m2: Any, v2: Any, p16: Any, bad: Any, c: Any, q: Any
) -> None:
    decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
    step_size, bc2s, eps, scale = c[5], c[6], c[7], c[8]
    n = p.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    for _ in numba.prange(q[1]):
        tb = np.empty(CHUNK, np.float32)
        tm = np.empty(CHUNK, m.dtype)
        tv = np.empty(CHUNK, v.dtype)
        t16 = np.empty(CHUNK, np.uint16)
        while True:
            blk = _claim(q)
            if blk >= nb:
                break
            flag = 0
            for s in range(blk * BLOCK, min(n, (blk + 1) * BLOCK), CHUNK):
                e = min(n, s + CHUNK)
                ps, hs, ms, vs = p[s:e], g16[s:e], m[s:e], v[s:e]
                for i in range(e - s):
                    raw = _widen16(hs[i])
                    flag |= (raw - raw) != 0  # inf - inf and nan - nan are nan
                    gi = raw / scale
                    pi = ps[i]
                    tb[i] = pi
                    gi = gi + l2 * pi
                    m0 = _wide(ms[i])
                    mi = m0 + omb1 * (gi - m0)
                    vi = b2 * _wide(vs[i]) + omb2 * gi * gi
                    pn = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                    ps[i] = pn
                    tm[i] = _moment(mi, ms[i])
                    tv[i] = _moment(vi, vs[i])
                    t16[i] = _narrow16(pn)
                _stream(p16, s, t16, e - s)
                _stream(bak, s, tb, e - s)
                _stream(m2, s, tm, e - s)
                _stream(v2, s, tv, e - s)
            _store_fence()
            bad[blk] = flag
