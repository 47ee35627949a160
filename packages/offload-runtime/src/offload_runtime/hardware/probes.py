"""The measurements of a hardware profile, one function per probe.

The numbers the solver needs are measured on the device itself; this module holds:

- pinned host-to-device and device-to-host copy rates, swept over transfer sizes from
  1 KiB to 1 GiB (powers of 4), because small copies pay a fixed latency that large ones
  do not (:func:`measure_copy_bandwidth`);
- the best rate of large square matrix products in the training dtype (the peak), and the
  rate on the model's own matrix-product shapes relative to it (the efficiency);
- fused Adam throughput over fp32 tensors on the device;
- the host's rate of fp16/bf16 <-> fp32 copies (gradient widening and weight publishing);
- the host's memory (DRAM) bandwidth, read by a large fp32 host-to-host copy;
- how much of its fused Adam rate the host keeps while pinned copies run both ways (they
  share host memory with it);
- the device memory bandwidth, and the rate of fused attention at one shape.

The host Adam rate is read by ``host_step.py`` and the per-operation issue cost by
``issue_cost.py``. Device times are taken with CUDA events (:func:`cuda_time_per_call_s`),
host times with ``time.perf_counter``. ``profile.py`` runs the probes in order and
assembles the profile.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from offload_runtime.hardware.host_memory import available_host_memory_bytes
from offload_runtime.hardware.host_step import (
    HOST_ADAM_NUMEL,
    adam_params,
    fit_adam_numel,
    measure_host_step,
    torch_fused_adam_step,
)
from offload_runtime.hardware.identity import resolve_device
from offload_solver import BandwidthPoint

__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY",
    "SWEEP_SIZES_BYTES",
    "MatmulShape",
    "measure_attention_flop_per_s",
    "measure_copy_bandwidth",
    "measure_device_adam_params_per_s",
    "measure_device_memory_bytes_per_s",
    "measure_host_convert_elems_per_s",
    "measure_host_copy_contention",
    "measure_host_memory_bytes_per_s",
    "measure_matmul_efficiency",
    "measure_peak_matmul_flop_per_s",
]

MatmulShape = tuple[int, int, int]
"""``(m, k, n)`` of one matrix product ``[m, k] @ [k, n]`` (a linear layer: ``m`` tokens,
``k`` input features, ``n`` output features)."""

DEFAULT_COMPUTE_EFFICIENCY = 0.5
"""Fraction of the peak matmul rate assumed for a training step when no matrix shapes are
given. A guess, not a measurement: small products (few tokens) run well under the peak,
and products large enough to fill the device run near it. Pass ``matmul_shapes`` to
measure it for the model at hand."""

SWEEP_SIZES_BYTES: tuple[int, ...] = tuple(1024 * 4**i for i in range(11))
"""Copy sizes of the bandwidth sweep: 1 KiB, 4 KiB, ..., 1 GiB."""

_SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}

# Bounds that keep a whole CUDA profile to a few seconds.
_SMALL_COPY_TARGET_BYTES = 64 * 2**20
"""Small copies are issued back to back until about this many bytes move per repetition, so
that the timer's resolution (about 0.5 us) is not what is measured."""
_MAX_COPIES_PER_REP = 64
_PEAK_SQUARE_SIDES = (4096, 8192)
_MAX_DISTINCT_SHAPES = 32
_SHAPE_REP_TARGET_S = 2e-3
_MAX_SHAPE_ITERS = 200
_DEVICE_ADAM_NUMEL = 64 * 2**20
_DEVICE_COPY_BYTES = 2**30
HOST_CONVERT_NUMEL = 32 * 2**20
HOST_MEMORY_NUMEL = 64 * 2**20
"""fp32 elements of each buffer of the host memory bandwidth probe (256 MiB each, far
beyond any CPU's last-level cache, so that the copy streams from DRAM)."""
_CONTENTION_COPY_BYTES = 256 * 2**20
_COPY_RATE_HIGH_GUESS = 100e9
"""Bytes/s: above the line rate of PCIe Gen5 x16 (64 GB/s each way), so that the copies
queued under a host Adam step, sized with it, outlast the step."""
_LAUNCH_S = 20e-6
"""Generous host cost of issuing one copy; used to size the spin that hides issue time."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a training dtype the probes support, as cache files spell it."""
    try:
        return _SUPPORTED_DTYPES[dtype]
    except KeyError:
        allowed = ", ".join(f"torch.{n}" for n in _SUPPORTED_DTYPES.values())
        raise ValueError(f"dtype {dtype} is not supported for profiling; use {allowed}") from None


def count_shapes(shapes: Sequence[MatmulShape]) -> tuple[tuple[MatmulShape, int], ...]:
    """Distinct shapes with how often each occurs, sorted so the order given does not matter."""
    counts: Counter[MatmulShape] = Counter()
    for i, shape in enumerate(shapes):
        ok = (
            isinstance(shape, (tuple, list))
            and len(shape) == 3
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        )
        if not ok:
            raise ValueError(
                f"matmul_shapes[{i}] is {shape!r}; each shape must be (m, k, n) with three "
                "positive ints"
            )
        m, k, n = shape
        counts[(m, k, n)] += 1
    return tuple(sorted(counts.items()))


class Progress:
    """One short line per phase on stderr, or nothing."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[offload] hardware: {message}", file=sys.stderr, flush=True)


def measure_copy_bandwidth(
    device: torch.device, sizes_bytes: Sequence[int] = SWEEP_SIZES_BYTES
) -> tuple[tuple[BandwidthPoint, ...], tuple[BandwidthPoint, ...]]:
    """Pinned ``(h2d, d2h)`` copy rates in bytes/s at each size that fits.

    Copies are ``copy_(non_blocking=True)`` on a side stream (as the runtime's copy streams
    issue them), timed with CUDA events, median of several repetitions. Sizes above a
    quarter of the free device memory or of the available host memory are left out.
    """
    sizes = sorted(set(sizes_bytes))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"sizes_bytes {list(sizes_bytes)!r} must be non-empty and positive")
    free_device, _ = torch.cuda.mem_get_info(device)
    room = min(free_device, available_host_memory_bytes() or free_device) // 4
    fitting = [s for s in sizes if s <= room] or sizes[:1]
    host, dev_buf = _copy_buffers(device, fitting[-1])
    fitting = [s for s in fitting if s <= host.numel()]
    # A side stream, as the runtime's H2D / D2H streams are.
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    h2d: list[BandwidthPoint] = []
    d2h: list[BandwidthPoint] = []
    for size in fitting:
        src_host, dst_dev = host[:size], dev_buf[:size]
        iters = max(1, min(_MAX_COPIES_PER_REP, _SMALL_COPY_TARGET_BYTES // size))
        reps = 5 if size <= _SMALL_COPY_TARGET_BYTES else 3
        up_s = cuda_time_per_call_s(
            _copy_fn(dst_dev, src_host),
            stream=stream,
            iters=iters,
            reps=reps,
            hide_launch=True,
        )
        down_s = cuda_time_per_call_s(
            _copy_fn(src_host, dst_dev),
            stream=stream,
            iters=iters,
            reps=reps,
            hide_launch=True,
        )
        h2d.append(BandwidthPoint(size_bytes=size, bytes_per_s=size / up_s))
        d2h.append(BandwidthPoint(size_bytes=size, bytes_per_s=size / down_s))
    del host, dev_buf
    return tuple(h2d), tuple(d2h)


def _copy_buffers(device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pinned host buffer and a device buffer of ``size`` bytes, smaller if pinning fails.

    One pair serves every size of the sweep (as slices): pinning 1 GiB takes a noticeable
    fraction of a second, and doing it once per size would dominate the sweep.
    """
    while True:
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            dev_buf = torch.empty(size, dtype=torch.uint8, device=device)
            return host, dev_buf
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if size <= 2**10:
                raise RuntimeError(
                    f"could not allocate {size} bytes of pinned host memory and device memory "
                    f"for the copy sweep ({exc}); free some memory, or raise the locked-memory "
                    "limit (ulimit -l) if pinning is refused"
                ) from exc
            size //= 4


def measure_peak_matmul_flop_per_s(
    device: torch.device, *, dtype: torch.dtype = torch.float16
) -> float:
    """The best FLOP/s of square ``dtype`` matrix products of side 4096 and 8192.

    Random operands (zeros run faster than real data would). float32 runs whatever
    ``torch.backends.cuda.matmul.allow_tf32`` currently selects.
    """
    dtype_name(dtype)
    element = torch.empty((), dtype=dtype).element_size()
    free_device, _ = torch.cuda.mem_get_info(device)
    sides = [n for n in _PEAK_SQUARE_SIDES if 3 * n * n * element <= free_device // 2]
    if not sides:
        sides = [1024]
    best = 0.0
    _warm_up_clocks(device, dtype)
    for n in sorted(sides, reverse=True):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        flop = 2 * n**3
        iters = max(2, min(50, math.ceil(20e-3 * 1e15 / flop)))
        seconds = cuda_time_per_call_s(
            _mm_fn(a, b, out),
            stream=torch.cuda.current_stream(device),
            iters=iters,
            reps=3,
            warmup=2,
            statistic=min,
        )
        best = max(best, flop / seconds)
        del a, b, out
    return best


def measure_matmul_efficiency(
    device: torch.device,
    shapes: Sequence[MatmulShape],
    *,
    peak_flop_per_s: float,
    dtype: torch.dtype = torch.float16,
    progress: bool = False,
) -> float:
    """The model's matrix products' rate as a fraction of ``peak_flop_per_s``, in (0, 1].

    ``shapes`` lists ``(m, k, n)``, a shape counting once each time it occurs. Each shape
    is timed as three products: the forward ``[m,k]@[k,n]`` and the backward's
    ``[m,n]@[n,k]`` (input gradient) and ``[n,m]@[m,k]`` (weight gradient), each back to
    back as eager training issues them, so the launch overhead of small products counts.
    The result is total FLOP over total time, over the peak; only the 32 shapes with the
    most FLOP are timed (they carry the cost). Shapes whose operands would take more than
    half the free device memory are skipped; if all are, the default efficiency is
    returned with a warning.
    """
    if peak_flop_per_s <= 0:
        raise ValueError(f"peak_flop_per_s is {peak_flop_per_s}; must be > 0")
    dtype_label = dtype_name(dtype)
    counted = count_shapes(shapes)
    say = Progress(enabled=progress)
    top = sorted(counted, key=lambda sc: sc[1] * sc[0][0] * sc[0][1] * sc[0][2], reverse=True)
    top = top[:_MAX_DISTINCT_SHAPES]
    element = torch.empty((), dtype=dtype).element_size()
    total_flop = 0.0
    total_s = 0.0
    with torch.cuda.device(device):
        try:
            free_device, _ = torch.cuda.mem_get_info(device)
            stream = torch.cuda.current_stream(device)
            # The ratio to a peak measured on warm clocks needs warm clocks here too.
            _warm_up_clocks(device, dtype)
            for (m, k, n), count in top:
                if (m * k + k * n + m * n) * element > free_device // 2:
                    continue
                for mm, kk, nn in ((m, k, n), (m, n, k), (n, m, k)):
                    a = torch.randn(mm, kk, device=device, dtype=dtype)
                    b = torch.randn(kk, nn, device=device, dtype=dtype)
                    out = torch.empty(mm, nn, device=device, dtype=dtype)
                    flop = 2.0 * mm * kk * nn
                    iters = max(
                        1,
                        min(
                            _MAX_SHAPE_ITERS,
                            math.ceil(_SHAPE_REP_TARGET_S * peak_flop_per_s / flop),
                        ),
                    )
                    seconds = cuda_time_per_call_s(
                        _mm_fn(a, b, out),
                        stream=stream,
                        iters=iters,
                        reps=3,
                        warmup=2,
                    )
                    total_flop += count * flop
                    total_s += count * seconds
                    del a, b, out
        finally:
            release_cached_memory()
    if total_s <= 0:
        warnings.warn(
            "no matmul shape fits in free device memory; using the default compute "
            f"efficiency {DEFAULT_COMPUTE_EFFICIENCY}",
            stacklevel=2,
        )
        return DEFAULT_COMPUTE_EFFICIENCY
    rate = total_flop / total_s
    efficiency = min(1.0, rate / peak_flop_per_s)
    say(
        f"{len(top)} {dtype_label} matmul shape(s) with backward: {rate / 1e12:.0f} TFLOP/s "
        f"= {efficiency:.2f} of peak"
    )
    return efficiency


def measure_host_convert_elems_per_s(
    numel: int = HOST_CONVERT_NUMEL, *, dtype: torch.dtype = torch.float16, reps: int = 3
) -> float:
    """Host dtype-converting copies between ``dtype`` and float32, elements/s.

    What the runtime's host worker does to every host-state region each step: widen its
    ``dtype`` gradients into the fp32 accumulator, and publish the fp32 master into the
    ``dtype`` copy. Both directions are timed (median of ``reps`` each, after one untimed
    copy each that faults the pages in) over ``numel`` elements of plain host memory;
    the rate is ``numel`` over the mean of the two medians, with torch's current number of
    CPU threads. Pinned memory is not needed: a host-to-host copy runs at the same memory
    bandwidth, and pinning would only slow profiling down. Needs ``6 * numel`` bytes
    (fp16/bf16).
    """
    if numel < 1 or reps < 1:
        raise ValueError(f"numel ({numel}) and reps ({reps}) must be >= 1")
    dtype_name(dtype)
    narrow = torch.empty(numel, dtype=dtype)
    wide = torch.empty(numel, dtype=torch.float32)
    narrow.fill_(1.0)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        started = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - started

    timed(wide, narrow)
    timed(narrow, wide)
    widen_s = statistics.median(timed(wide, narrow) for _ in range(reps))
    publish_s = statistics.median(timed(narrow, wide) for _ in range(reps))
    return numel / max((widen_s + publish_s) / 2, 1e-9)


def measure_host_memory_bytes_per_s(numel: int = HOST_MEMORY_NUMEL, *, reps: int = 5) -> float:
    """Host memory (DRAM) stream bandwidth, bytes read plus written per second.

    Adds one preallocated fp32 host tensor of ``numel`` elements into another in place,
    with torch's current number of CPU threads (the threads the host optimizer's steps run
    with): one untimed pass first, which faults the pages in, then the median of ``reps``
    timed passes (``time.perf_counter``). Each pass moves ``3 * 4 * numel`` bytes: two
    arrays read, one written. The pass works in place as the host Adam kernels do, so its
    stores land on lines it has just read and make no write-allocate traffic, and its
    bytes count the way ``offload_solver.HOST_STATE_BYTES`` counts a host step's (a copy
    into a second buffer would also read every destination line before writing it, and
    counting two passes for it would read the memory a third slower than it is). The
    buffers must far exceed the last-level cache for this to be DRAM's rate (the default,
    256 MiB each, does; ``profile_hardware`` lowers it with :func:`fit_convert_numel` to
    fit available host memory). Needs ``8 * numel`` bytes.
    """
    if numel < 1 or reps < 1:
        raise ValueError(f"numel ({numel}) and reps ({reps}) must be >= 1")
    src = torch.full((numel,), 1e-6, dtype=torch.float32)
    dst = torch.zeros_like(src)
    dst.add_(src)
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        dst.add_(src)
        samples.append(time.perf_counter() - started)
    return 3 * src.nbytes / max(statistics.median(samples), 1e-9)


def measure_host_copy_contention(
    device: torch.device,
    numel: int = HOST_ADAM_NUMEL,
    *,
    steps: int = 7,
    copy_bytes: int = _CONTENTION_COPY_BYTES,
) -> float:
    """Fraction of its standalone rate fused host Adam keeps while pinned copies run.

    Times ``steps`` pairs of fused ``torch.optim.Adam`` steps
    (:func:`~offload_runtime.hardware.host_step.torch_fused_adam_step`) over ``numel``
    fp32 host parameters: one alone, then one while a host-to-device and a device-to-host
    stream each copy a ``copy_bytes`` pinned buffer back to back (as the runtime's
    prefetches and gradient copies do during a step), and returns the ratio of the
    medians, in (0, 1]. Each sample is one step timed here, started right after the
    copies it runs under are queued; the standalone rate that sizes the copies is read by
    :func:`~offload_runtime.hardware.host_step.measure_host_step`.
    The two kinds alternate so that a host that slows down or speeds up while this runs
    (other work on a shared machine) moves both medians alike; measured as one block after
    the other, a host that slowed down in between would read far too low. The copies
    are queued for three times the standalone step (doubled whenever they finished before
    the step did), so they run for its whole duration. Needs ``16 * numel`` bytes of host
    memory, ``2 * copy_bytes`` pinned, and ``2 * copy_bytes`` on the device (``copy_bytes``
    is lowered to fit a quarter of the free memory on either side).
    """
    if numel < 1 or steps < 1 or copy_bytes < 1:
        raise ValueError(
            f"numel ({numel}), steps ({steps}) and copy_bytes ({copy_bytes}) must be >= 1"
        )
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_host_copy_contention needs a CUDA device, got {device!r}")
    step = torch_fused_adam_step(numel)
    alone_s = measure_host_step(step, numel, steps=1).median_s  # sizes the copies; not a sample

    counts = itertools.count(3)  # measure_host_step made calls 1 and 2

    def timed_step() -> float:
        started = time.perf_counter()
        step(next(counts))
        return time.perf_counter() - started

    # Two buffers on each side: keep them within a quarter of what is free, as the sweep does.
    free_device, _ = torch.cuda.mem_get_info(dev)
    room = min(free_device, available_host_memory_bytes() or free_device) // 8
    copy_bytes = max(1 << 20, min(copy_bytes, room))
    up_src, down_dst = (
        torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
    )
    up_dst, down_src = (torch.empty(copy_bytes, dtype=torch.uint8, device=dev) for _ in range(2))
    up = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    down = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    up_dst.copy_(up_src, non_blocking=True)  # first touch of the buffers and streams
    torch.cuda.synchronize(dev)
    copy_s = max(copy_bytes / _COPY_RATE_HIGH_GUESS, 1e-6)
    copies = max(2, math.ceil(3 * alone_s / copy_s))
    alone: list[float] = []
    samples: list[float] = []
    attempts = 0
    while len(samples) < steps and attempts < 4 * steps:
        attempts += 1
        if len(alone) == len(samples):  # each sample under copies has its own alone
            alone.append(timed_step())
        done = []
        for stream, dst, src in ((up, up_dst, up_src), (down, down_dst, down_src)):
            with torch.cuda.stream(stream):
                for _ in range(copies):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                done.append(event)
        took = timed_step()
        outlasted = not any(event.query() for event in done)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(dev)
        if outlasted:
            samples.append(took)
        else:  # a copy stream ran dry before the step ended: queue more and retry
            copies *= 2
    del up_src, down_dst, up_dst, down_src
    if not samples:
        raise RuntimeError(
            "the copies never outlasted a host Adam step; the device's copies seem far "
            "faster than assumed"
        )
    return min(1.0, statistics.median(alone[: len(samples)]) / statistics.median(samples))


def measure_device_adam_params_per_s(
    device: torch.device, numel: int = _DEVICE_ADAM_NUMEL, *, steps: int = 5
) -> float:
    """Fused ``torch.optim.Adam`` over ``numel`` fp32 parameters on a CUDA device: elements/s.

    Timed with CUDA events; ``numel`` is lowered to fit a quarter of the free memory (each
    element needs 16 bytes: parameter, gradient, two moments).
    """
    if numel < 1 or steps < 1:
        raise ValueError(f"numel ({numel}) and steps ({steps}) must be >= 1")
    free_device, _ = torch.cuda.mem_get_info(device)
    numel = fit_adam_numel(numel, free_device)
    params = adam_params(numel, device)
    optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)
    seconds = cuda_time_per_call_s(
        optimizer.step, stream=torch.cuda.current_stream(device), iters=steps, reps=3
    )
    del optimizer, params
    return numel / seconds


def measure_attention_flop_per_s(
    device: torch.device | str,
    *,
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    reps: int = 5,
) -> tuple[float, float]:
    """(forward, backward) rates of causal fused attention at one shape, FLOP/s.

    Runs ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on ``[batch, heads,
    seq, head_dim]`` tensors that need gradients, and its backward, and divides the FLOPs
    ``torch.utils.flop_counter`` counts for each (the count the trace records for the
    profile's attention operations; where it counts none, as for the CPU's kernel, its
    ``sdpa_flop_count`` formulas) by its median time: for
    ``HardwareProfile.attention_fwd_flop_per_s`` / ``attention_bwd_flop_per_s``, which
    ``profile_hardware`` leaves to ``memory_optimize`` (it measures at the model's own
    shapes). On CUDA the times are the device's (events,
    several calls back to back); the backward's is that of forward and backward less the
    forward's. ``dtype`` defaults to float16 on CUDA and float32 on the CPU. Measure at
    the model's own shape and dropout (``dropout_p``): a head size the kernel pads (the
    example zoo's GPT-2 XL has 32 heads of 50) and dropout in attention both change the
    rate.
    """
    from torch.nn import functional as F
    from torch.utils.flop_counter import (
        FlopCounterMode,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if min(batch, heads, seq, head_dim, reps) < 1:
        raise ValueError(
            f"batch, heads, seq, head_dim and reps must be >= 1, got {batch}, {heads}, "
            f"{seq}, {head_dim}, {reps}"
        )
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=dev, dtype=dtype)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    def both() -> None:
        for t in (q, k, v):
            t.grad = None
        torch.autograd.backward(forward(), grad)

    with FlopCounterMode(display=False) as counter:
        out = forward()
    fwd_flop = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        torch.autograd.backward(out, grad)
    bwd_flop = counter.get_total_flops()
    if not fwd_flop or not bwd_flop:
        # The CPU's fused kernel has no formula registered: count as the flash kernel's.
        fwd_flop = sdpa_flop_count(shape, shape, shape)  # type: ignore[no-untyped-call]
        bwd_flop = sdpa_backward_flop_count(shape, shape, shape, shape)  # type: ignore[no-untyped-call]
    if dev.type == "cuda":
        stream = torch.cuda.current_stream(dev)
        iters = 4
        fwd_s = cuda_time_per_call_s(forward, stream=stream, iters=iters, reps=reps)
        both_s = cuda_time_per_call_s(both, stream=stream, iters=iters, reps=reps)
    else:

        def timed(fn: Callable[[], object]) -> float:
            fn()
            samples = []
            for _ in range(reps):
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
            return statistics.median(samples)

        fwd_s = timed(forward)
        both_s = timed(both)
    bwd_s = max(both_s - fwd_s, 1e-9)
    return fwd_flop / max(fwd_s, 1e-9), bwd_flop / bwd_s


def measure_device_memory_bytes_per_s(
    device: torch.device, size_bytes: int = _DEVICE_COPY_BYTES, *, iters: int = 5
) -> float:
    """Device memory bandwidth of a CUDA device: bytes read plus written per second by an
    on-device copy of ``size_bytes`` (lowered to fit an eighth of the free memory).

    Timed with CUDA events, median of three repetitions of ``iters`` copies.
    """
    if size_bytes < 1 or iters < 1:
        raise ValueError(f"size_bytes ({size_bytes}) and iters ({iters}) must be >= 1")
    if torch.device(device).type != "cuda":
        raise ValueError(f"measure_device_memory_bytes_per_s needs a CUDA device, got {device!r}")
    free_device, _ = torch.cuda.mem_get_info(device)
    size = max(2**20, min(size_bytes, free_device // 8))
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = cuda_time_per_call_s(
        lambda: dst.copy_(src), stream=torch.cuda.current_stream(device), iters=iters, reps=3
    )
    return 2 * size / seconds


def fit_convert_numel(numel: int, room_bytes: int) -> int:
    """Shrink a host copy measurement (a conversion, or the host memory bandwidth's copy:
    at most 8 bytes per element) to a quarter of ``room_bytes``."""
    if room_bytes <= 0:
        return numel
    return max(2**16, min(numel, room_bytes // 4 // 8))


def _copy_fn(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
    def copy() -> object:
        return dst.copy_(src, non_blocking=True)

    return copy


def _mm_fn(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    def mm() -> object:
        return torch.mm(a, b, out=out)

    return mm


def cuda_time_per_call_s(
    fn: Callable[[], object],
    *,
    stream: torch.cuda.Stream,
    iters: int,
    reps: int,
    warmup: int = 1,
    hide_launch: bool = False,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> float:
    """``statistic`` (default median) over ``reps`` of the device time of ``iters``
    back-to-back calls, per call.

    ``hide_launch`` first queues a spin kernel so that all ``iters`` calls are issued
    before the start event fires: the time is then the device's, not the host's issue
    rate (which matters for microsecond copies).
    """
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    sleep = getattr(torch.cuda, "_sleep", None)
    clock_hz = 1e3 * torch.cuda.get_device_properties(stream.device).clock_rate
    samples = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        for _ in range(reps):
            if hide_launch and sleep is not None:
                sleep(int(min(iters * _LAUNCH_S, 5e-3) * clock_hz))
            start.record(stream)
            for _ in range(iters):
                fn()
            end.record(stream)
            # Sync point: the host waits so that each repetition starts on an idle stream.
            end.synchronize()
            samples.append(float(start.elapsed_time(end)) / 1e3 / iters)
    return max(statistic(samples), 1e-9)


def _warm_up_clocks(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> None:
    """Run matrix products for ``seconds`` so the device leaves its idle clocks.

    An idle GPU sits at a fraction of its boost clock: without this, the peak read on a
    fresh process is several percent low. Skipped when the device has too little free
    memory for the operands.
    """
    n = 4096
    element = torch.empty((), dtype=dtype).element_size()
    free_device, _ = torch.cuda.mem_get_info(device)
    if 3 * n * n * element > free_device // 2:
        return
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            torch.mm(a, b, out=out)
        # Sync point: bounds the queued work so the loop ends near ``seconds``.
        torch.cuda.synchronize(device)


def release_cached_memory() -> None:
    """Return the profiler's device blocks and pinned host blocks to the system.

    Profiling runs before the model is placed; its gigabyte buffers would otherwise stay
    in torch's caching allocators, and the pinned host allocator never splits a cached
    block, so a 1 GiB pinned block would be held for the life of the process.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()


def fmt_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:g} {unit}"
    return f"{size_bytes} B"
