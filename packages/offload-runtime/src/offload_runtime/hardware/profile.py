"""The hardware profile of a device: from the cache, or measured by the probes.

:func:`profile_hardware` is the entry point: it loads the profile of a device and dtype
from the cache (see [Note: hardware cache] in ``cache.py``) or measures it
(:func:`measure_hardware`, which runs the probes of ``probes.py``, ``host_step.py`` and
``issue_cost.py`` and assembles their readings). A CUDA profile takes a few seconds. On
the CPU no measurement is made: :func:`default_cpu_profile` returns documented constants
so that CPU tests are deterministic.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from offload_runtime.hardware import cache
from offload_runtime.hardware.attention import (
    AttentionShape,
    measure_attention_at,
    with_attention_rates,
)
from offload_runtime.hardware.host_memory import (
    available_host_memory_bytes,
    total_host_memory_bytes,
)
from offload_runtime.hardware.host_step import (
    HOST_ADAM_NUMEL,
    fit_adam_numel,
    host_adam_median,
    measure_host_adam_params_per_s,
    measure_host_step_rates,
)
from offload_runtime.hardware.identity import DeviceIdentity, device_identity, resolve_device
from offload_runtime.hardware.issue_cost import measure_op_overhead_s
from offload_runtime.hardware.probes import (
    DEFAULT_COMPUTE_EFFICIENCY,
    HOST_CONVERT_NUMEL,
    HOST_MEMORY_NUMEL,
    MatmulShape,
    Progress,
    count_shapes,
    dtype_name,
    fit_convert_numel,
    fmt_size,
    measure_copy_bandwidth,
    measure_device_adam_params_per_s,
    measure_device_memory_bytes_per_s,
    measure_host_convert_elems_per_s,
    measure_host_copy_contention,
    measure_host_memory_bytes_per_s,
    measure_matmul_efficiency,
    measure_peak_matmul_flop_per_s,
    release_cached_memory,
)
from offload_solver import BandwidthPoint, HardwareProfile, default_host_step_rates

__all__ = ["default_cpu_profile", "measure_hardware", "profile_hardware"]


def default_cpu_profile() -> HardwareProfile:
    """The profile used when the "device" is the CPU: constants, not a measurement.

    On the CPU the runtime's uploads and offloads are copies between two host tensors, and
    a profile only has to let the solver and simulator run. These numbers are the same on
    every machine so that plans, and the CPU tests built on them, are deterministic:

    - copies: 10 GB/s both ways at every size (points at 1 KiB and 1 GiB);
    - compute: 100 GFLOP/s at efficiency 0.5;
    - memory: 16 GiB "device", 64 GiB host (not this machine's; use
      :func:`available_host_memory_bytes` for that);
    - Adam: 1e9 parameters/s on host and "device"; the other host kernels' rates derived
      from it by their documented ratios (``offload_solver.default_host_step_rates``:
      BENCHMARKS.md, Decisions, "Single-pass host Adam"), so that a CPU plan chooses among
      them as a GPU machine's would;
    - memory bandwidths, host and device: unknown (0), as the conversion rate is: the
      plans need neither, and no constant would say anything about this machine.
    """
    flat = (BandwidthPoint(size_bytes=2**10, bytes_per_s=10e9), BandwidthPoint(2**30, 10e9))
    return HardwareProfile(
        name="cpu-default (constants, not measured)",
        h2d=flat,
        d2h=flat,
        compute_flop_per_s=100e9,
        compute_efficiency=0.5,
        device_memory_bytes=16 * 2**30,
        host_memory_bytes=64 * 2**30,
        host_adam_params_per_s=1e9,
        device_adam_params_per_s=1e9,
        host_step_rates=default_host_step_rates(1e9),
    )


def profile_hardware(
    device: torch.device | str | None = None,
    *,
    force: bool = False,
    cache_dir: Path | None = None,
    dtype: torch.dtype = torch.float16,
    matmul_shapes: Sequence[MatmulShape] = (),
    attention_shapes: Sequence[AttentionShape] = (),
    progress: bool = True,
) -> HardwareProfile:
    """The hardware profile of ``device``, from the cache when present, else measured.

    To measure again (say, after a profile was taken while something else loaded the
    host, which the profile's and ``memory_optimize``'s warnings tell), call it with
    ``force=True`` and the training dtype, e.g.
    ``profile_hardware("cuda", dtype=torch.bfloat16, force=True)``: the next
    ``memory_optimize`` on this device reads the new profile from the cache.

    Args:
        device: a CUDA device, ``"cpu"``, or ``None`` for the current CUDA device when CUDA
            is available and the CPU otherwise. The CPU gets :func:`default_cpu_profile`
            (not measured, not cached).
        force: re-measure even when a cached profile exists, overwrite the cache, and
            remove the cached profiles of this device and dtype built on the replaced
            measurements for other matrix shapes (each model's is re-timed when next
            asked for).
        cache_dir: folder of the cache files; default
            :func:`~offload_runtime.hardware.cache.default_cache_dir` (the environment
            variable ``OFFLOAD_CACHE_DIR``, see [Note: hardware cache]).
        dtype: training dtype of the matrix products (float16, bfloat16 or float32).
        matmul_shapes: the model's matrix products as ``(m, k, n)``, repeats counting once
            each time they occur. Each is timed with the two products of its backward pass,
            and ``compute_efficiency`` is their FLOP-weighted rate over the peak. Empty:
            :data:`DEFAULT_COMPUTE_EFFICIENCY`.
        attention_shapes: the model's fused attention calls; their rates
            (``attention_fwd_flop_per_s`` / ``attention_bwd_flop_per_s``) are measured at
            these shapes and cached with the matrix shapes' profile. Empty: the profile's
            (unknown, 0: priced at the matrix products' rate).
        progress: print one line per phase to stderr.

    Raises:
        RuntimeError: a CUDA device is named and CUDA is not available.
        ValueError: an unsupported device type or dtype, or a malformed shape.
    """
    dtype_label = dtype_name(dtype)
    shapes = count_shapes(matmul_shapes)
    dev = resolve_device(device)
    if dev.type == "cpu":
        return default_cpu_profile()

    say = Progress(enabled=progress)
    identity = device_identity(dev)
    attention = tuple(
        sorted(
            (a.batch, a.heads, a.seq, a.head_dim, a.dropout_p, a.calls) for a in attention_shapes
        )
    )
    files = cache.cache_files(cache_dir, identity.cache_key, dtype_label, shapes, attention)

    base: HardwareProfile | None = None
    if not force:
        if files.shapes is not None:
            cached = cache.load_cached(files.shapes)
            if cached is not None:
                say(f"loaded {cached.name} from {files.shapes}")
                return cached
        base = cache.load_cached(files.base)
        if base is not None:
            say(f"loaded {base.name} from {files.base}")

    if base is None:
        started = time.perf_counter()
        say(f"profiling {identity.name} ({dev}, {dtype_label}); this takes a few seconds")
        base = measure_hardware(dev, dtype=dtype, identity=identity, progress=progress)
        say(f"profiled in {time.perf_counter() - started:.1f} s")
        cache.store(files.base, base, say)
        if force:
            files.drop_shape_files()  # they copy the measurements just replaced
    if files.shapes is None:
        return base

    profile = base
    if shapes:
        efficiency = measure_matmul_efficiency(
            dev,
            matmul_shapes,
            peak_flop_per_s=base.compute_flop_per_s,
            dtype=dtype,
            progress=progress,
        )
        profile = dataclasses.replace(base, compute_efficiency=efficiency)
    if attention_shapes:
        say(f"timing fused attention at {len(attention)} shape(s)")
        profile = with_attention_rates(
            profile,
            list(attention_shapes),
            lambda shape: measure_attention_at(dev, shape, dtype=dtype),
        )
    cache.store(files.shapes, profile, say)
    return profile


def measure_hardware(
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float16,
    identity: DeviceIdentity | None = None,
    progress: bool = False,
) -> HardwareProfile:
    """Measure a CUDA device now, without the cache; ``compute_efficiency`` is the default.

    Copies, peak matmul, both Adam rates, host copy contention, device and host memory
    bandwidths, the conversion rate, the per-operation issue cost, and the rate of every
    host step the optimizer can run here (:func:`measure_host_step_rates`); the host Adam
    rate and the issue cost are each the median of three reads (first, midway and last;
    :func:`host_adam_median`). Several seconds on a current GPU machine.
    """
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_hardware needs a CUDA device, got {device!r}")
    dtype_label = dtype_name(dtype)
    ident = identity if identity is not None else device_identity(dev)
    say = Progress(enabled=progress)
    with torch.cuda.device(dev):
        try:
            # The issue cost is read three times (first, midway and last) and the median
            # kept: single reads on one machine spread widely, and a launch-bound plan's
            # step scales with it. The median drops one disturbed read without leaning low
            # or high.
            overheads = [measure_op_overhead_s(dev, dtype=dtype)]
            h2d, d2h = measure_copy_bandwidth(dev)
            say(
                f"copies {fmt_size(h2d[0].size_bytes)}..{fmt_size(h2d[-1].size_bytes)}: "
                f"H2D {h2d[-1].bytes_per_s / 1e9:.1f} GB/s, D2H {d2h[-1].bytes_per_s / 1e9:.1f}"
                f" GB/s at {fmt_size(h2d[-1].size_bytes)}"
            )
            peak = measure_peak_matmul_flop_per_s(dev, dtype=dtype)
            say(f"peak {dtype_label} matmul {peak / 1e12:.0f} TFLOP/s")
            adam_numel = fit_adam_numel(HOST_ADAM_NUMEL, available_host_memory_bytes())
            host_adams = [measure_host_adam_params_per_s(adam_numel)]
            device_adam = measure_device_adam_params_per_s(dev)
            overheads.append(measure_op_overhead_s(dev, dtype=dtype))
            say(
                f"fused Adam host {host_adams[0] / 1e9:.2f} Gparam/s (first read), "
                f"device {device_adam / 1e9:.1f} Gparam/s"
            )
            contention = measure_host_copy_contention(
                dev, fit_adam_numel(HOST_ADAM_NUMEL, available_host_memory_bytes())
            )
            say(f"host Adam keeps {contention:.2f} of its rate while pinned copies run")
            device_memory = measure_device_memory_bytes_per_s(dev)
            say(f"device memory {device_memory / 1e12:.2f} TB/s (read + write)")
            host_adams.append(measure_host_adam_params_per_s(adam_numel))
            host_convert = measure_host_convert_elems_per_s(
                fit_convert_numel(HOST_CONVERT_NUMEL, available_host_memory_bytes()),
                dtype=dtype,
            )
            say(f"host {dtype_label} <-> float32 conversion {host_convert / 1e9:.2f} Gelem/s")
            memory_numel = fit_convert_numel(HOST_MEMORY_NUMEL, available_host_memory_bytes())
            host_memory = measure_host_memory_bytes_per_s(memory_numel)
            say(
                f"host memory {host_memory / 1e9:.1f} GB/s (read + write, a copy of "
                f"{fmt_size(4 * memory_numel)} with {torch.get_num_threads()} CPU threads)"
            )
            overheads.append(measure_op_overhead_s(dev, dtype=dtype))
            host_adams.append(measure_host_adam_params_per_s(adam_numel))
            host_adam = host_adam_median(host_adams)
            say(
                f"fused Adam host {host_adam / 1e9:.2f} Gparam/s (the median of "
                f"{', '.join(f'{x / 1e9:.2f}' for x in host_adams)} Gparam/s read first, "
                f"midway and last, with {torch.get_num_threads()} CPU threads)"
            )
            host_steps = measure_host_step_rates(
                fit_adam_numel(HOST_ADAM_NUMEL, available_host_memory_bytes(), 28), host_adam
            )
            say(
                "host steps "
                + ", ".join(
                    f"{r.kernel}/{r.state}{'/fp16_io' if r.fp16_io else ''}"
                    f"{'/speculative' if r.speculative else ''} {r.params_per_s / 1e9:.2f}"
                    for r in host_steps
                )
                + " Gparam/s"
            )
            overhead = statistics.median(overheads)
            say(
                f"per-operation issue cost {overhead * 1e6:.1f} us (GPT-2-like graph; the "
                f"median of {', '.join(f'{x * 1e6:.1f}' for x in overheads)} us read first, "
                "midway and last)"
            )
            _, device_total = torch.cuda.mem_get_info(dev)
        finally:
            release_cached_memory()
    return HardwareProfile(
        name=f"{ident.name} ({dtype_label})",
        h2d=h2d,
        d2h=d2h,
        compute_flop_per_s=peak,
        compute_efficiency=DEFAULT_COMPUTE_EFFICIENCY,
        device_memory_bytes=int(device_total),
        host_memory_bytes=total_host_memory_bytes(),
        host_adam_params_per_s=host_adam,
        device_adam_params_per_s=device_adam,
        op_overhead_s=overhead,
        host_convert_elems_per_s=host_convert,
        device_memory_bytes_per_s=device_memory,
        host_memory_bytes_per_s=host_memory,
        host_copy_contention=contention,
        host_step_rates=host_steps,
    )
