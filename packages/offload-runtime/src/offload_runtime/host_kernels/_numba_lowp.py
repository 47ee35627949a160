"""The numba kernels behind :mod:`offload_runtime.host_kernels.low_precision` (imported only
when used).

See [Note: bf16 master weights] in low_precision.py. ``c`` is single_pass's constants
array (decay, l2, 1 - beta1, beta2, 1 - beta2, step size, sqrt(bias correction 2), eps,
grad scale; the write-back flag is ignored: these kernels never write the gradient). The
step's arithmetic is _numba_adam's, statement for statement, so a bf16-master step computes
what the fp32-master kernels would compute from the same widened values. Every kernel
releases the GIL and its threads claim blocks (``q``) as in _numba_adam.py.

``key`` picks the master's rounding when the kernel compiles: None rounds to nearest even,
a pair of ints (the two 32-bit halves of the seed's key) rounds stochastically with the
random bits of :func:`_narrow_master`. One source, two machine codes, and no branch in the
loop. numba's disk cache is keyed on this file alone: the intrinsics imported from
_numba_adam.py are compiled into these kernels, so a change there must be followed by a
change here (or a cleared cache) for the cached kernels to see it.
"""

from __future__ import annotations

from typing import Any

import numba  # type: ignore[import-untyped, import-not-found, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, import-not-found, unused-ignore]
from numba import types
from numba.extending import intrinsic  # type: ignore[import-untyped, import-not-found, unused-ignore]

from offload_runtime.host_kernels._numba_adam import (
    BLOCK,
    _claim,
    _moment,
    _wide,
    bf16_bits_ir,
    bf16_nearest_ir,
)

QBLOCK = 256
"""Elements per quantization block of the 8-bit moments (low_precision.QBLOCK; BLOCK is a
multiple of it, so a claimed block holds whole quantization blocks)."""

# fmix32, the finalizer of MurmurHash3: a bijection of 32-bit words whose every output
# bit depends on every input bit. low_precision._fmix32 is the same function in torch.
_MIX1 = 0x85EBCA6B
_MIX2 = 0xC2B2AE35


def _fmix32_ir(builder: Any, x: Any) -> Any:
    i32 = ir.IntType(32)
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))
    x = builder.mul(x, ir.Constant(i32, _MIX1))
    x = builder.xor(x, builder.lshr(x, ir.Constant(i32, 13)))
    x = builder.mul(x, ir.Constant(i32, _MIX2))
    return builder.xor(x, builder.lshr(x, ir.Constant(i32, 16)))


def _narrow_master_typer(typingctx: Any, x: Any, index: Any, key: Any) -> Any:
    if x != types.float32 or not isinstance(index, types.Integer):
        return None
    stochastic = isinstance(key, types.UniTuple) and isinstance(key.dtype, types.Integer)
    if not stochastic and not isinstance(key, types.NoneType):
        return None
    sig = types.uint16(x, types.int64, key)  # the call casts the index to int64

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        if not stochastic:
            return bf16_nearest_ir(builder, bits)
        k0 = builder.trunc(builder.extract_value(args[2], 0), i32)
        k1 = builder.trunc(builder.extract_value(args[2], 1), i32)
        lo = builder.trunc(args[1], i32)
        hi = builder.trunc(builder.lshr(args[1], ir.Constant(ir.IntType(64), 32)), i32)
        h = _fmix32_ir(builder, builder.xor(lo, k0))
        h = _fmix32_ir(builder, builder.xor(builder.xor(h, k1), hi))
        return bf16_bits_ir(builder, bits, builder.lshr(h, ir.Constant(i32, 16)))

    return sig, codegen


_narrow_master: Any = intrinsic(_narrow_master_typer)
"""``_narrow_master(x, index, key)``: the bf16 bits (uint16) of the fp32 ``x``, rounded to
nearest even (``key`` None) or stochastically: the top 16 bits of
``fmix32(fmix32(lo ^ k0) ^ k1 ^ hi)`` (``index`` = hi * 2**32 + lo, ``key`` = (k0, k1))
added to the bits of ``x`` before the low 16 are dropped."""


def _bits_typer(typingctx: Any, x: Any) -> Any:
    if x != types.float32:
        return None
    sig = types.int32(x)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


def _float_typer(typingctx: Any, x: Any) -> Any:
    if x != types.int32:
        return None
    sig = types.float32(x)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_bits: Any = intrinsic(_bits_typer)
"""The bits of an fp32 value as an int32. For values >= 0 their order is the values'
order, so a block's absmax is an integer max reduction, which vectorizes without
fast-math flags (a floating-point max reduction does not)."""
_float: Any = intrinsic(_float_typer)
"""The fp32 value of an int32's bits (``_bits``'s inverse)."""


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def in_place_bf16(p: Any, g: Any, m: Any, v: Any, c: Any, key: Any, q: Any) -> None:
    decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
    step_size, bc2s, eps, scale = c[5], c[6], c[7], c[8]
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
                gi = _wide(gs[i]) / scale
                pi = _wide(ps[i])
                gi = gi + l2 * pi
                m0 = _wide(ms[i])
                mi = m0 + omb1 * (gi - m0)
                vi = b2 * _wide(vs[i]) + omb2 * gi * gi
                pn = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                ps[i] = _narrow_master(pn, s + i, key)
                ms[i] = _moment(mi, ms[i])
                vs[i] = _moment(vi, vs[i])


@numba.njit(parallel=True, nogil=True, error_model="numpy", cache=True)  # type: ignore[untyped-decorator, unused-ignore]
def in_place_bf16_8bit(
    p: Any, g: Any, mq: Any, mscale: Any, vq: Any, vscale: Any, c: Any, k: Any, key: Any, q: Any
) -> None:
    """``k`` holds the quantization's fp32 constants (low_precision._QUANT): 127, 127**2,
    255, 255**2, 0.5 and the smallest normal fp32 value (the flush threshold, compared as
    bits with the absmax's bits)."""
    decay, l2, omb1, b2, omb2 = c[0], c[1], c[2], c[3], c[4]
    step_size, bc2s, eps, scale = c[5], c[6], c[7], c[8]
    m_top, m_top2, v_top, v_top2, half = k[0], k[1], k[2], k[3], k[4]
    tiny = _bits(k[5])
    zero, one = np.float32(0.0), np.float32(1.0)
    n = p.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    for _ in numba.prange(q[1]):
        tm = np.empty(QBLOCK, np.float32)
        tv = np.empty(QBLOCK, np.float32)
        while True:
            blk = _claim(q)
            if blk >= nb:
                break
            for s in range(blk * BLOCK, min(n, (blk + 1) * BLOCK), QBLOCK):
                e = min(n, s + QBLOCK)
                j = s // QBLOCK
                km = mscale[j] / m_top2
                kv = vscale[j] / v_top2 / v_top2
                ps, gs, mqs, vqs = p[s:e], g[s:e], mq[s:e], vq[s:e]
                am = np.int32(0)
                av = np.int32(0)
                for i in range(e - s):
                    cm = np.float32(mqs[i])
                    cv = np.float32(vqs[i])
                    cv = cv * cv
                    gi = _wide(gs[i]) / scale
                    pi = _wide(ps[i])
                    gi = gi + l2 * pi
                    m0 = cm * np.abs(cm) * km
                    mi = m0 + omb1 * (gi - m0)
                    vi = b2 * (cv * cv * kv) + omb2 * gi * gi
                    pn = pi * decay - step_size * mi / (np.sqrt(vi) / bc2s + eps)
                    ps[i] = _narrow_master(pn, s + i, key)
                    tm[i] = mi
                    tv[i] = vi
                    am = max(am, _bits(np.abs(mi)))
                    av = max(av, _bits(vi))
                # Requantize against the new absmax; a block below the smallest normal
                # value is flushed to zero (its reciprocal would overflow).
                if am < tiny:
                    mscale[j] = zero
                    for i in range(e - s):
                        mqs[i] = 0
                else:
                    top = _float(am)
                    mscale[j] = top
                    inv = one / top
                    for i in range(e - s):
                        x = tm[i]
                        y = min(np.floor(np.sqrt(np.abs(x) * inv) * m_top + half), m_top)
                        mqs[i] = np.int8(-y if x < zero else y)
                if av < tiny:
                    vscale[j] = zero
                    for i in range(e - s):
                        vqs[i] = 0
                else:
                    top = _float(av)
                    vscale[j] = top
                    inv = one / top
                    for i in range(e - s):
                        x = tv[i]
                        y = min(np.floor(np.sqrt(np.sqrt(x * inv)) * v_top + half), v_top)
                        y = max(y, one if x > zero else zero)  # nonzero stays nonzero
                        vqs[i] = np.uint8(y)
