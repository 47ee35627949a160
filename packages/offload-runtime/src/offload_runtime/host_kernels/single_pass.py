"""Single-pass host Adam kernels, compiled with numba (a dependency of offload-runtime where
numba has wheels: x86_64 and aarch64).

[Note: single-pass host Adam]
torch's fused CPU Adam works in place. An exact undo of a speculative fp16 step (see [Note:
speculative steps] in ``offload_optim/speculation.py``) therefore copies the master and
moments before each chunk's fused step: five parallel passes per chunk. The kernels here do
it in one pass: each element's master, gradient and moments are read once, and the step
writes the master in place, the old master into the backup and the new moments into the
spare pair, while it checks the gradient for non-finite values. The plain step gets a
kernel of the same arithmetic, so that a committed speculative step equals the plain step
bit for bit. The arithmetic is torch's fused AdamW/Adam formula in fp32 (decay or L2, lerp
of the first moment, the bias-corrected update); it differs from torch's kernel in rounding
only (about 1e-7 of the update: FMA contraction and operation order). So a run steps every
host region with one family of kernels (the plan's ``PlanOptions.host_kernel``). bf16
moments (see [Note: bf16 moments] in torch_adam.py) are widened and narrowed (round to
nearest even) element by element inside the same loop, with integer operations that
vectorize with it (_numba_adam.py), where torch's route makes five parallel passes per
chunk: 20 bytes per parameter move instead of 28.

Two details keep the kernels at the memory rate (measured with
``python benchmarks/host_adam_bench.py``; BENCHMARKS.md, Decisions, "Single-pass
host Adam"): each kernel's loop is written out over slices of one block (a shared inlined
helper returning a tuple, or numba's default error model for division, keeps the loop from
vectorizing: scalar square roots and divisions), and the gradient check is an integer OR
of ``g - g != 0``, which vectorizes without reassociating floating-point sums.

Launches hold a module lock: numba's portable thread pool ("workqueue") must not be
entered from two threads at once, and the optimizer steps from the host worker and the
main thread. Each launch uses torch's intra-op thread count, and its threads claim blocks
as they free up ([Note: blocks claimed as threads free up] in _numba_adam.py). The
kernels compile on first use (a few seconds, cached on disk by numba).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from offload_runtime.host_kernels.torch_adam import AdamHyper

_launch_lock = threading.Lock()


def available() -> bool:
    """Whether numba can be imported (the kernels then compile on first use)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


UNAVAILABLE = (
    "numba cannot be imported here, so host optimizer steps run torch's fused CPU Adam: "
    "the single-pass host step is lost, and with it fp16 gradients and parameters read and "
    "written inside the host step (fp16 I/O), speculative fp16 host steps at little more "
    "than a plain step's cost, and faster bf16 moments. Install numba (pip install numba; "
    "offload-runtime depends on it on x86_64 and aarch64) to get them."
)
"""What :func:`warn_unavailable` says."""

_warned = threading.Event()


def warn_unavailable() -> None:
    """Warn once per process (:data:`UNAVAILABLE`) that the single-pass kernels cannot
    load: the planner then plans torch's kernels."""
    if not _warned.is_set():
        _warned.set()
        warnings.warn(UNAVAILABLE, RuntimeWarning, stacklevel=2)


def require() -> None:
    """Raise ImportError, saying how to install it, when numba is missing."""
    if not available():
        raise ImportError(
            "the single-pass host kernels need numba, which cannot be imported here: "
            "pip install numba"
        )


def _constants(hyper: AdamHyper, step: float, grad_scale: torch.Tensor | None) -> Any:
    import numpy as np

    bc1 = 1.0 - hyper.beta1**step
    bc2 = 1.0 - hyper.beta2**step
    decay = 1.0 - hyper.lr * hyper.weight_decay if hyper.adamw else 1.0
    l2 = 0.0 if hyper.adamw else hyper.weight_decay
    scale = 1.0 if grad_scale is None else float(grad_scale)
    return np.array(
        [
            decay,
            l2,
            1.0 - hyper.beta1,
            hyper.beta2,
            1.0 - hyper.beta2,
            hyper.lr / bc1,
            math.sqrt(bc2),
            hyper.eps,
            scale,
            0.0 if grad_scale is None else 1.0,
        ],
        dtype=np.float32,
    )


def _flat(t: torch.Tensor, what: str, dtype: torch.dtype = torch.float32) -> Any:
    """``t`` as a flat numpy array sharing its memory; bf16 and fp16 as their bits
    (uint16: numba has neither type)."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(
            f"single-pass Adam steps contiguous host tensors, {dtype} here; {what} is "
            f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"
        )
    flat = t.view(-1)
    if dtype in (torch.bfloat16, torch.float16):
        import numpy as np

        return flat.view(torch.int16).numpy().view(np.uint16)
    return flat.numpy()


def _moments_dtype(exp_avg: torch.Tensor) -> torch.dtype:
    if exp_avg.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"single-pass Adam keeps moments in float32 or bfloat16, not {exp_avg.dtype}"
        )
    return exp_avg.dtype


def _launch(kernel: Callable[..., None], *args: Any) -> None:
    """Run ``kernel(*args, q)`` on torch's intra-op thread count; ``q`` is (the shared
    block counter the kernel's threads claim from, the thread count)."""
    import numba
    import numpy as np

    with _launch_lock:
        most = int(getattr(numba.config, "NUMBA_NUM_THREADS", 1))
        threads = max(1, min(torch.get_num_threads(), most))
        numba.set_num_threads(threads)
        q = np.array([0, threads], dtype=np.int64)
        # Its own span: a trace tells the wait for the lock from the kernel.
        with torch.profiler.record_function("single-pass kernel"):
            kernel(*args, q)


def _check_numel(n: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.numel() != n:
            raise ValueError(f"single-pass Adam: {name} has {t.numel()} elements, not {n}")


@torch.no_grad()
def adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step of an fp32 host tensor, in place, in one pass.

    Moments are fp32 or bf16 (both of one dtype); bf16 ones are widened and narrowed
    (round to nearest even) inside the pass.

    ``step`` (0-dim) already counts this step. The gradient is divided by ``grad_scale``
    (0-dim fp32) when given and written back divided, as torch's fused kernel leaves it.
    """
    require()
    _check_numel(param.numel(), grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    moments = _moments_dtype(exp_avg)
    from offload_runtime.host_kernels import _numba_adam  # imports numba: only once it is needed

    arrays = [
        _flat(param, "param"),
        _flat(grad, "grad"),
        _flat(exp_avg, "exp_avg", moments),
        _flat(exp_avg_sq, "exp_avg_sq", moments),
    ]
    _launch(_numba_adam.in_place, *arrays, _constants(hyper, float(step), grad_scale))


@torch.no_grad()
def speculative_adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    next_avg: torch.Tensor,
    next_avg_sq: torch.Tensor,
    backup: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`adam_` that keeps what an exact undo needs, in the same single pass.

    Writes the old master into ``backup``, steps ``param`` in place and writes the new
    moments into ``next_avg`` / ``next_avg_sq`` (``exp_avg`` / ``exp_avg_sq`` are only
    read). The values equal :func:`adam_`'s bit for bit. Returns the overflow partial:
    a 0-dim fp32 tensor, ``inf`` when an element of the gradient (before unscaling) is
    not finite, else 0 (the contract of ``kernels.speculative_adam_``'s sum).
    """
    require()
    n = param.numel()
    _check_numel(
        n,
        grad=grad,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        next_avg=next_avg,
        next_avg_sq=next_avg_sq,
        backup=backup,
    )
    import numpy as np

    moments = _moments_dtype(exp_avg)
    from offload_runtime.host_kernels import _numba_adam

    bad = np.zeros((n + _numba_adam.BLOCK - 1) // _numba_adam.BLOCK, dtype=np.uint8)  # per block
    f32 = torch.float32
    named = (
        (param, "param", f32),
        (grad, "grad", f32),
        (exp_avg, "exp_avg", moments),
        (exp_avg_sq, "exp_avg_sq", moments),
        (backup, "backup", f32),
        (next_avg, "next_avg", moments),
        (next_avg_sq, "next_avg_sq", moments),
    )
    arrays = [_flat(t, name, dtype) for t, name, dtype in named]
    _launch(_numba_adam.speculative, *arrays, bad, _constants(hyper, float(step), grad_scale))
    return torch.tensor(math.inf if bad.any() else 0.0, dtype=torch.float32)


@cache
def fp16_io_available() -> bool:
    """Whether the fp16-in/fp16-out kernels compile here and convert exactly as torch.

    They widen and narrow with the CPU's half-precision instructions (F16C on x86; see
    _numba_adam.py). Checked once: every fp16 value widened, and fp32 values around every
    rounding case (ties, subnormals, overflow, inf, NaN) narrowed, against torch's
    conversions. False without numba or when the check fails.
    """
    if not available():
        return False
    import numpy as np

    try:
        from offload_runtime.host_kernels import _numba_adam

        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        halves = every.view(torch.float16)
        wide = np.empty(every.numel(), np.float32)
        narrow = np.empty(0, np.uint16)
        bits = every.numpy().view(np.uint16)
        with _launch_lock:
            _numba_adam.convert16(bits, wide, narrow, True)
        got = torch.from_numpy(wide)
        want = halves.float()
        same_wide = bool(torch.equal(got.isnan(), want.isnan())) and bool(
            torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        )
        # Midpoints between neighbouring fp16 values (ties), and values just either side.
        finite = want[want.isfinite()].sort().values  # +0 and -0 twice: harmless
        mids = (finite[:-1].double() + finite[1:].double()) / 2
        probe = torch.cat(
            [
                finite,
                mids.float(),
                torch.nextafter(mids.float(), torch.tensor(math.inf)),
                torch.nextafter(mids.float(), torch.tensor(-math.inf)),
                torch.tensor([65520.0, -65520.0, 1e6, math.inf, -math.inf, 1e-9, -1e-9]),
            ]
        )
        out = np.empty(probe.numel(), np.uint16)
        with _launch_lock:
            _numba_adam.convert16(bits[:0], probe.numpy(), out, False)
        same_narrow = bool(
            torch.equal(torch.from_numpy(out.view(np.int16)), probe.half().view(torch.int16))
        )
    except Exception:  # no F16C lowering, a JIT that cannot link the helper: not offered
        return False
    return same_wide and same_narrow


def require_fp16_io() -> None:
    """Raise RuntimeError when :func:`fp16_io_available` is False, saying why it matters."""
    require()
    if not fp16_io_available():
        raise RuntimeError(
            "fp16_io needs the CPU's half-precision conversions in numba's kernels, and "
            "they failed to compile or to match torch's rounding on this machine; plan "
            "without fp16 I/O (the host then widens and narrows in separate passes)"
        )


def _fp16_args(
    param: torch.Tensor, grad16: torch.Tensor, exp_avg: torch.Tensor, param16: torch.Tensor
) -> tuple[list[Any], torch.dtype]:
    """The master and fp16 gradient as arrays, and the moments' dtype."""
    require_fp16_io()
    _check_numel(param.numel(), grad16=grad16, exp_avg=exp_avg, param16=param16)
    arrays = [_flat(param, "param"), _flat(grad16, "grad16", torch.float16)]
    return arrays, _moments_dtype(exp_avg)


@torch.no_grad()
def adam_fp16_io_(
    param: torch.Tensor,
    grad16: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param16: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """:func:`adam_` from an fp16 gradient, writing the new master's fp16 copy too.

    ``grad16`` is widened (exact) and divided by ``grad_scale`` in the pass, and is not
    written; ``param16`` receives the new fp32 ``param`` rounded to fp16 (nearest even,
    as ``param.half()``). ``param16`` may be ``grad16`` itself. Master and moments (fp32
    or bf16, both of one dtype) equal :func:`adam_`'s on ``grad16.float()`` bit for bit.
    """
    arrays, moments = _fp16_args(param, grad16, exp_avg, param16)
    arrays += [
        _flat(exp_avg, "exp_avg", moments),
        _flat(exp_avg_sq, "exp_avg_sq", moments),
        _flat(param16, "param16", torch.float16),
    ]
    from offload_runtime.host_kernels import _numba_adam

    _launch(_numba_adam.in_place_fp16_io, *arrays, _constants(hyper, float(step), grad_scale))


@torch.no_grad()
def speculative_adam_fp16_io_(
    param: torch.Tensor,
    grad16: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    next_avg: torch.Tensor,
    next_avg_sq: torch.Tensor,
    backup: torch.Tensor,
    param16: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`speculative_adam_` from an fp16 gradient, writing ``param16`` as
    :func:`adam_fp16_io_` does (an undo must rewrite it from the restored master).
    Returns the overflow partial (``inf`` when an element of ``grad16`` is not finite)."""
    arrays, moments = _fp16_args(param, grad16, exp_avg, param16)
    _check_numel(param.numel(), next_avg=next_avg, next_avg_sq=next_avg_sq, backup=backup)
    import numpy as np

    from offload_runtime.host_kernels import _numba_adam

    n = param.numel()
    bad = np.zeros((n + _numba_adam.BLOCK - 1) // _numba_adam.BLOCK, dtype=np.uint8)
    arrays += [
        _flat(exp_avg, "exp_avg", moments),
        _flat(exp_avg_sq, "exp_avg_sq", moments),
        _flat(backup, "backup"),
        _flat(next_avg, "next_avg", moments),
        _flat(next_avg_sq, "next_avg_sq", moments),
        _flat(param16, "param16", torch.float16),
    ]
    constants = _constants(hyper, float(step), grad_scale)
    _launch(_numba_adam.speculative_fp16_io, *arrays, bad, constants)
    return torch.tensor(math.inf if bad.any() else 0.0, dtype=torch.float32)
