"""Host Adam(W) kernels for bf16 master weights: the low rungs of the host state's
precision ladder.

[Note: bf16 master weights]
The existing host kernels keep an fp32 master and fp32 or bf16 moments (single_pass.py,
torch_adam.py). The rungs here keep the master in bf16 too:
- ``bf16_nearest`` / ``bf16_stochastic`` (:func:`adam_bf16_`): bf16 master and bf16
  moments, 6 bytes of host state per parameter (fp32 master and moments: 12);
- ``bf16_8bit`` (:func:`adam_bf16_8bit_`): bf16 master and both moments quantized to 8
  bits in blocks of :data:`QBLOCK` elements with one fp32 absmax per block and moment:
  2 + 1 + 1 + 8 / 256, about 4.03 bytes per parameter.
Each step widens master, gradient (bf16 or fp32) and moments to fp32, computes torch's
fused AdamW/Adam formula in fp32 with the arithmetic of _numba_adam.py statement for
statement (decay or L2, lerp of the first moment, the bias-corrected update), and narrows
the results, all in one pass over each element (bytes moved per parameter:
``offload_solver.HOST_STATE_BYTES``; the 8-bit rung's per-block scales add 16 bytes a
block of 256, which it rounds away).

Rounding the master. Round-to-nearest-even loses every update smaller than half a bf16
ulp (2**-9 to 2**-8 of the weight). An Adam update is about lr in size, so at small
learning rates many are (1e-4 against a weight of 0.1), and those weights stall.
Stochastic rounding rounds up with probability equal to the distance
from the lower neighbour in ulps, so the rounded master equals the fp32 one in
expectation and small updates accumulate. It adds a uniform 16-bit integer to the fp32
bits and drops the low 16 bits (the same carry that nearest rounding uses, with a random
addend instead of ``0x7FFF`` plus the kept lowest bit): inf stays inf (the addend never
reaches the exponent of an inf), a NaN becomes the NaN 0x7FC0, and a finite value
overflows to inf only when it lies beyond the largest bf16 value, with the probability
of its distance beyond it in ulps (inf standing for the next value, 2**128, as it does
for round-to-nearest's overflow). The random bits are a counter-based hash, not a
generator's stream: the top 16 bits of ``fmix32(fmix32(lo ^ k0) ^ k1 ^ hi)`` for the
element's index ``hi * 2**32 + lo`` in the tensor, with (k0, k1) the two halves of
splitmix64 of ``seed`` (fmix32 is MurmurHash3's finalizer). So a rounding depends only on
(seed, index, value): the same for any thread count or block schedule, bit for bit the
same in the numba kernel and the torch reference (which computes the hash in int64 with
the same wraparound), and it costs a few vectorized integer operations per element. The
caller derives ``seed`` from the step count and the region, so every step and region
draws other bits.

Quantizing the moments (``bf16_8bit``). Each block of 256 elements is dequantized,
stepped and requantized against its new absmax in the same pass; the scale is the
block's absmax itself (fp32), so the largest element of a block is exact and a block
whose moments all decay decays exactly. Within the block:
- the first moment is signed int8 on a square-root map, ``code = round(127 *
  sqrt(|m| / absmax))`` with m's sign, decoded as ``absmax * code * |code| / 127**2``:
  relative resolution about ``1 / code`` near a code, and values down to about 6e-5 of
  the absmax get a nonzero code (a linear map would zero everything below 0.4%, and a
  block's gradients routinely span more than that);
- the second moment is uint8 on a fourth-root map (the square-root map of ``sqrt(v)``),
  ``code = round(255 * (v / absmax) ** 0.25)``, decoded as ``absmax * (code / 255)**4``.
  v spans the square of the gradients' range, and the update depends on ``sqrt(v)``,
  whose relative resolution this gives is about ``2 / code``, down to 1.5e-5 of the
  block's largest ``sqrt(v)``. A nonzero v never gets code 0: a zero denominator would
  make that element's update ``m / eps``, the failure of linearly quantized Adam; the
  smallest code instead overestimates v, which only shrinks that element's update.
Codes round to nearest (ties up), deterministically. As with bf16 moments ([Note: bf16
moments] in torch_adam.py), a moment that moves by less than half a code in a step keeps
its code, but the block's scale follows its largest element exactly. test_low_precision.py
trains a classifier with every rung against fp32 AdamW (``QUALITY_TOLERANCE``). A block
whose absmax is 0, or below the smallest normal fp32 value (whose reciprocal would
overflow), is stored as scale 0 and all-zero codes. The round-trip error of
:func:`quantize_moments_` then :func:`dequantize_moments`, with ``a`` the block's absmax,
is at most
``a * (sqrt(|m| / a) / 127 + 1 / (4 * 127**2))`` for m, and for v ``2 * a * (y + 1 / 510)**3
/ 255`` with ``y = (v / a) ** 0.25``, or ``a / 255**4`` where the smallest code stands in for
a smaller nonzero v (plus fp32 rounding); test_low_precision.py measures it.
Non-finite gradients are not checked (a step with them must be skipped before, as the
gradient scaler does): they make the master NaN and the block's codes unspecified.

The numba kernels (_numba_lowp.py) follow single_pass.py: the launch lock, torch's
thread count, blocks claimed as threads free up, ``nogil``, bf16 as uint16 bits widened
and narrowed with integer operations in the loop. The torch references
(:func:`reference_adam_bf16_`, :func:`reference_adam_bf16_8bit_`) compute the same thing
chunk by chunk in bounded memory and equal the kernels bit for bit (each fp32 operation
is one IEEE operation on both sides; torch's fp32 ``sqrt`` is not always correctly
rounded on the CPU, so the references take it in fp64, which is); the public functions
fall back to them when numba is missing.
"""

from __future__ import annotations

import torch

from offload_runtime.host_kernels import single_pass
from offload_runtime.host_kernels.single_pass import _check_numel, _constants, _flat, _launch
from offload_runtime.host_kernels.torch_adam import AdamHyper

QBLOCK = 256
"""Elements per quantization block of the 8-bit moments (one fp32 scale each per moment)."""

REFERENCE_CHUNK = 1 << 18
"""Elements per chunk of the torch references (a multiple of :data:`QBLOCK`): their
temporaries stay a few MiB whatever the tensor's size."""

_FLT_MIN = 2.0**-126
_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_QUANT = (127.0, 127.0**2, 255.0, 255.0**2, 0.5, _FLT_MIN)
"""The quantization's constants, in fp32 for the kernel (``_numba_lowp.in_place_bf16_8bit``)."""


QUANT_DTYPES = (torch.int8, torch.uint8)
"""Dtypes of the 8-bit codes of the first and the second moment."""


def rounding_seed(step: int, region: int, start: int) -> int:
    """The stochastic-rounding seed of one launch: step count ``step`` of the segment at
    element ``start`` of region ``region`` (any ints; :func:`seed_key` mixes them), so that
    every step and segment draws other bits and a resumed run draws the same ones."""
    return ((step & 0xFFFFFFFF) << 32) ^ ((region & 0xFFFF) << 16) ^ (start * 0x9E3779B1)


def quantized_numel(n: int) -> int:
    """Scale entries per moment for ``n`` elements: one per block of :data:`QBLOCK`."""
    return (n + QBLOCK - 1) // QBLOCK


def seed_key(seed: int) -> tuple[int, int]:
    """The two 32-bit halves of splitmix64's output for ``seed`` (taken modulo 2**64):
    the key of the rounding hash ([Note: bf16 master weights])."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z & _MASK32, z >> 32


def _mul32(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * k`` modulo 2**32 for int64 ``x`` in [0, 2**32) and ``k`` in [2**31, 2**32):
    ``x * k = -x * (2**32 - k)`` modulo 2**32, and that product fits in int64."""
    return (-(x * ((1 << 32) - k))) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix32 on uint32 values held in int64 (``_numba_lowp._fmix32_ir``)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def random16(start: int, n: int, key: tuple[int, int]) -> torch.Tensor:
    """The stochastic rounding's addends (int64 in [0, 2**16)) of elements ``start`` to
    ``start + n`` of a tensor, for the key :func:`seed_key` gives."""
    index = torch.arange(start, start + n, dtype=torch.int64)
    h = _fmix32((index & _MASK32) ^ key[0])
    h = _fmix32(h ^ key[1] ^ (index >> 32))
    return h >> 16


def round_bf16(x: torch.Tensor, start: int, key: tuple[int, int] | None) -> torch.Tensor:
    """Flat fp32 ``x`` (elements ``start`` onwards of a tensor) rounded to bf16 as the
    kernels do: to nearest even when ``key`` is None (``x.to(torch.bfloat16)`` but for a
    NaN's bits, always 0x7FC0 here), else stochastically with :func:`random16`'s
    addends."""
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    addend = 0x7FFF + ((bits >> 16) & 1) if key is None else random16(start, x.numel(), key)
    out = (bits + addend) >> 16
    out = torch.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, out)
    return ((out ^ 0x8000) - 0x8000).to(torch.int16).view(torch.bfloat16)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (fp64's, rounded once: exact for sqrt)."""
    return x.double().sqrt_().float()


def _adam(
    p: torch.Tensor, g: torch.Tensor, m0: torch.Tensor, v0: torch.Tensor, c: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The new fp32 master and moments, as ``_numba_adam.in_place`` computes them."""
    decay, l2, omb1, b2, omb2, step_size, bc2s, eps, scale = c[:9]
    gi = g / scale
    gi = gi + l2 * p
    mi = m0 + omb1 * (gi - m0)
    vi = b2 * v0 + omb2 * gi * gi
    pn = p * decay - step_size * mi / (_sqrt(vi) / bc2s + eps)
    return pn, mi, vi


def _dequantize(
    mq: torch.Tensor, ms: torch.Tensor, vq: torch.Tensor, vs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 moments of codes shaped (blocks, width) and their scales (blocks,)."""
    cm = mq.float()
    m = cm * cm.abs() * (ms / _QUANT[1]).unsqueeze(1)
    cv = vq.float()
    cv = cv * cv
    v = cv * cv * (vs / _QUANT[3] / _QUANT[3]).unsqueeze(1)
    return m, v


def _quantize(
    m: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes and scales of fp32 moments shaped (blocks, width), as the kernel makes them."""
    top, _, vtop, _, half, tiny = _QUANT
    am = m.abs().amax(dim=1)
    av = v.amax(dim=1)
    m_flush, v_flush = (am < tiny).unsqueeze(1), (av < tiny).unsqueeze(1)
    am = torch.where(am < tiny, 0.0, am)
    av = torch.where(av < tiny, 0.0, av)
    inv = (1.0 / torch.where(am == 0, 1.0, am)).unsqueeze(1)
    y = torch.floor(_sqrt(m.abs() * inv) * top + half).clamp_max_(top)
    y = torch.where(m < 0, -y, y)
    mq = torch.where(m_flush, 0.0, y).to(torch.int8)
    inv = (1.0 / torch.where(av == 0, 1.0, av)).unsqueeze(1)
    y = torch.floor(_sqrt(_sqrt(v * inv)) * vtop + half).clamp_max_(vtop)
    y = torch.maximum(y, (v > 0).float())
    vq = torch.where(v_flush, 0.0, y).to(torch.uint8)
    return mq, am, vq, av


def _rows(n: int) -> list[tuple[int, int, int]]:
    """(start, end, block width) of the reference's pieces: whole chunks of whole blocks,
    then the last partial block alone."""
    pieces = []
    whole = n - n % QBLOCK
    for s in range(0, whole, REFERENCE_CHUNK):
        pieces.append((s, min(whole, s + REFERENCE_CHUNK), QBLOCK))
    if whole < n:
        pieces.append((whole, n, n - whole))
    return pieces


def _check_bf16_step(
    master: torch.Tensor, grad: torch.Tensor, *moments: torch.Tensor
) -> list[object]:
    """Validate master, gradient and bf16 moments; their flat arrays (bits for bf16)."""
    if grad.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"a bf16-master step reads a bf16 or fp32 gradient, not {grad.dtype}")
    named = dict(zip(("exp_avg", "exp_avg_sq")[: len(moments)], moments, strict=True))
    _check_numel(master.numel(), grad=grad, **named)
    arrays = [_flat(master, "master", torch.bfloat16), _flat(grad, "grad", grad.dtype)]
    return arrays + [_flat(t, name, torch.bfloat16) for name, t in named.items()]


def _check_quantized(
    n: int, m_q: torch.Tensor, m_scale: torch.Tensor, v_q: torch.Tensor, v_scale: torch.Tensor
) -> list[object]:
    """Validate 8-bit moments of ``n`` elements; their flat arrays."""
    _check_numel(n, m_q=m_q, v_q=v_q)
    _check_numel(quantized_numel(n), m_scale=m_scale, v_scale=v_scale)
    return [
        _flat(m_q, "m_q", QUANT_DTYPES[0]),
        _flat(m_scale, "m_scale"),
        _flat(v_q, "v_q", QUANT_DTYPES[1]),
        _flat(v_scale, "v_scale"),
    ]


@torch.no_grad()
def adam_bf16_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
    *,
    stochastic: bool,
    seed: int,
) -> None:
    """One Adam(W) step of a bf16 host master with bf16 moments, in place, in one pass.

    ``master``, ``exp_avg``, ``exp_avg_sq``: contiguous bf16 CPU tensors of one numel,
    read and written. ``grad``: contiguous bf16 or fp32, only read; divided by
    ``grad_scale`` (0-dim fp32) when given. ``step`` (0-dim) already counts this step.
    The step is fp32 arithmetic on the widened values; the moments are narrowed to nearest
    even, the master to nearest even or, with ``stochastic``, stochastically with the
    bits of (``seed``, element index) ([Note: bf16 master weights]). Runs numba's kernel,
    or :func:`reference_adam_bf16_` (the same bits) when numba is missing.
    """
    arrays = _check_bf16_step(master, grad, exp_avg, exp_avg_sq)
    if not single_pass.available():
        reference_adam_bf16_(
            master, grad, exp_avg, exp_avg_sq, step, hyper, grad_scale,
            stochastic=stochastic, seed=seed,
        )  # fmt: skip
        return
    from offload_runtime.host_kernels import _numba_lowp  # imports numba: only once needed

    key = seed_key(seed) if stochastic else None
    constants = _constants(hyper, float(step), grad_scale)
    _launch(_numba_lowp.in_place_bf16, *arrays, constants, key)


@torch.no_grad()
def reference_adam_bf16_(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
    *,
    stochastic: bool,
    seed: int,
) -> None:
    """:func:`adam_bf16_` in torch, chunk by chunk (:data:`REFERENCE_CHUNK`): the same
    arguments and the same bits."""
    _check_bf16_step(master, grad, exp_avg, exp_avg_sq)
    c = [float(x) for x in _constants(hyper, float(step), grad_scale)]
    key = seed_key(seed) if stochastic else None
    p, g = master.view(-1), grad.view(-1)
    m, v = exp_avg.view(-1), exp_avg_sq.view(-1)
    n = p.numel()
    for s in range(0, n, REFERENCE_CHUNK):
        e = min(n, s + REFERENCE_CHUNK)
        pn, mi, vi = _adam(p[s:e].float(), g[s:e].float(), m[s:e].float(), v[s:e].float(), c)
        p[s:e] = round_bf16(pn, s, key)
        m[s:e] = round_bf16(mi, s, None)
        v[s:e] = round_bf16(vi, s, None)


@torch.no_grad()
def adam_bf16_8bit_(
    master: torch.Tensor,
    grad: torch.Tensor,
    m_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
    *,
    seed: int,
) -> None:
    """One Adam(W) step of a bf16 host master with 8-bit block-quantized moments, in one
    pass ([Note: bf16 master weights]).

    ``master``: contiguous bf16, read and written (rounded stochastically with the bits
    of (``seed``, element index)). ``grad``: bf16 or fp32, only read; divided by
    ``grad_scale`` (0-dim fp32) when given. ``m_q`` (int8) and ``v_q`` (uint8), one code
    per element, and ``m_scale`` / ``v_scale`` (fp32, :func:`quantized_numel` entries: each
    block's absmax) are read and written: each block of :data:`QBLOCK` elements is
    dequantized, stepped in fp32 and requantized against its new absmax. Build them from
    fp32 moments with :func:`quantize_moments_` (zeros for a fresh state). ``step``
    (0-dim) already counts this step. Runs numba's kernel, or
    :func:`reference_adam_bf16_8bit_` (the same bits) when numba is missing.
    """
    arrays = _check_bf16_step(master, grad)
    arrays += _check_quantized(master.numel(), m_q, m_scale, v_q, v_scale)
    if not single_pass.available():
        reference_adam_bf16_8bit_(
            master, grad, m_q, m_scale, v_q, v_scale, step, hyper, grad_scale, seed=seed
        )
        return
    import numpy as np

    from offload_runtime.host_kernels import _numba_lowp

    assert _numba_lowp.QBLOCK == QBLOCK, "the kernel's blocks are the state's"
    constants = _constants(hyper, float(step), grad_scale)
    quant = np.array(_QUANT, dtype=np.float32)
    _launch(_numba_lowp.in_place_bf16_8bit, *arrays, constants, quant, seed_key(seed))


@torch.no_grad()
def reference_adam_bf16_8bit_(
    master: torch.Tensor,
    grad: torch.Tensor,
    m_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
    *,
    seed: int,
) -> None:
    """:func:`adam_bf16_8bit_` in torch, chunk by chunk (:data:`REFERENCE_CHUNK`): the
    same arguments and the same bits."""
    _check_bf16_step(master, grad)
    n = master.numel()
    _check_quantized(n, m_q, m_scale, v_q, v_scale)
    c = [float(x) for x in _constants(hyper, float(step), grad_scale)]
    key = seed_key(seed)
    p, g = master.view(-1), grad.view(-1)
    mq, vq = m_q.view(-1), v_q.view(-1)
    for s, e, w in _rows(n):
        blocks = slice(s // QBLOCK, (e + QBLOCK - 1) // QBLOCK)
        m0, v0 = _dequantize(
            mq[s:e].view(-1, w), m_scale[blocks], vq[s:e].view(-1, w), v_scale[blocks]
        )
        pn, mi, vi = _adam(p[s:e].float(), g[s:e].float(), m0.view(-1), v0.view(-1), c)
        p[s:e] = round_bf16(pn, s, key)
        codes_m, m_scale[blocks], codes_v, v_scale[blocks] = _quantize(
            mi.view(-1, w), vi.view(-1, w)
        )
        mq[s:e] = codes_m.view(-1)
        vq[s:e] = codes_v.view(-1)


def step_bf16_master_(
    state: str,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
    *,
    seed: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    numba: bool = True,
) -> None:
    """One step of a bf16-master rung ``state`` (``"bf16_stochastic"``, ``"bf16_8bit"``,
    ``"bf16_nearest"``) as the optimizer runs it: :func:`adam_bf16_` (stochastic unless
    ``"bf16_nearest"``), or for ``"bf16_8bit"`` :func:`adam_bf16_8bit_` with ``exp_avg``
    / ``exp_avg_sq`` the codes and ``scales`` their per-block scales; the torch
    references where ``numba`` is False (a plan that runs torch's host kernels)."""
    if state == "bf16_8bit":
        if scales is None:
            raise ValueError("the 8-bit rung steps its moments' codes with their scales")
        kernel8 = adam_bf16_8bit_ if numba else reference_adam_bf16_8bit_
        m_scale, v_scale = scales
        kernel8(
            master, grad, exp_avg, m_scale, exp_avg_sq, v_scale, step, hyper, grad_scale,
            seed=seed,
        )  # fmt: skip
        return
    if state not in ("bf16_stochastic", "bf16_nearest"):
        raise ValueError(f"{state!r} is not a bf16-master rung")
    kernel = adam_bf16_ if numba else reference_adam_bf16_
    kernel(
        master, grad, exp_avg, exp_avg_sq, step, hyper, grad_scale,
        stochastic=state == "bf16_stochastic", seed=seed,
    )  # fmt: skip


@torch.no_grad()
def quantize_moments_(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    m_q: torch.Tensor,
    m_scale: torch.Tensor,
    v_q: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write the 8-bit state of :func:`adam_bf16_8bit_` for the moments ``exp_avg`` and
    ``exp_avg_sq`` (any floating dtype, one numel, ``exp_avg_sq`` >= 0): codes and scales
    as the kernel's requantization makes them (for a checkpoint's load, or a state that
    starts from fp32 moments; zeros give zeros)."""
    n = exp_avg.numel()
    _check_numel(n, exp_avg_sq=exp_avg_sq)
    _check_quantized(n, m_q, m_scale, v_q, v_scale)
    m, v = exp_avg.reshape(-1), exp_avg_sq.reshape(-1)
    mq, vq = m_q.view(-1), v_q.view(-1)
    for s, e, w in _rows(n):
        blocks = slice(s // QBLOCK, (e + QBLOCK - 1) // QBLOCK)
        codes_m, m_scale[blocks], codes_v, v_scale[blocks] = _quantize(
            m[s:e].float().view(-1, w), v[s:e].float().view(-1, w)
        )
        mq[s:e] = codes_m.view(-1)
        vq[s:e] = codes_v.view(-1)


@torch.no_grad()
def dequantize_moments(
    m_q: torch.Tensor, m_scale: torch.Tensor, v_q: torch.Tensor, v_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 moments (flat: ``exp_avg``, ``exp_avg_sq``) that 8-bit state stands for,
    exactly as :func:`adam_bf16_8bit_` reads them."""
    n = m_q.numel()
    _check_quantized(n, m_q, m_scale, v_q, v_scale)
    m = torch.empty(n, dtype=torch.float32)
    v = torch.empty(n, dtype=torch.float32)
    mq, vq = m_q.view(-1), v_q.view(-1)
    for s, e, w in _rows(n):
        blocks = slice(s // QBLOCK, (e + QBLOCK - 1) // QBLOCK)
        mb, vb = _dequantize(
            mq[s:e].view(-1, w), m_scale[blocks], vq[s:e].view(-1, w), v_scale[blocks]
        )
        m[s:e] = mb.view(-1)
        v[s:e] = vb.view(-1)
    return m, v
