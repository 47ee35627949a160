"""Measure what this machine can move and compute, as an ``offload_solver.HardwareProfile``.

The numbers the solver needs are measured on the device itself, not looked up by the
device's name, cached per device, and on the CPU replaced by documented constants. By
responsibility:

- ``identity.py``: which device a profile belongs to (:class:`DeviceIdentity`), the key
  of the cache;
- ``cache.py``: where profiles are cached, reading and writing them ([Note: hardware
  cache]); the cache's location is the only environment variable the library reads;
- ``probes.py``: one function per device measurement (copy sweep, matmul peak and
  efficiency, device Adam, host conversion, host memory bandwidth, copy contention, device
  memory, attention);
- ``host_step.py``: :func:`measure_host_step`, the one timer of host optimizer steps,
  used for the profile's host Adam rate and every host kernel's
  (:func:`measure_host_step_rates`; [Note: one host step timer]);
- ``issue_cost.py``: the host cost of issuing one operation of a traced graph;
- ``attention.py``: fused attention's rates at a model's own shapes, kept with its
  matrix shapes' profile;
- ``host_memory.py``: the host's total and available memory;
- ``profile.py``: :func:`profile_hardware` (cache or measure) and
  :func:`default_cpu_profile`.
"""

from __future__ import annotations

from offload_runtime.hardware.attention import (
    AttentionShape,
    measure_attention_at,
    with_attention_rates,
)
from offload_runtime.hardware.cache import default_cache_dir
from offload_runtime.hardware.host_memory import (
    available_host_memory_bytes,
    total_host_memory_bytes,
)
from offload_runtime.hardware.host_step import (
    HOST_ADAM_READS_SPREAD,
    HostStep,
    HostStepTiming,
    KernelSteps,
    host_adam_median,
    host_step_configurations,
    kernel_steps,
    measure_host_adam_params_per_s,
    measure_host_step,
    measure_host_step_rates,
    torch_fused_adam_step,
)
from offload_runtime.hardware.identity import DeviceIdentity, device_identity, nvml_handle
from offload_runtime.hardware.issue_cost import measure_op_overhead_s
from offload_runtime.hardware.probes import (
    DEFAULT_COMPUTE_EFFICIENCY,
    SWEEP_SIZES_BYTES,
    MatmulShape,
    measure_attention_flop_per_s,
    measure_copy_bandwidth,
    measure_device_adam_params_per_s,
    measure_device_memory_bytes_per_s,
    measure_host_convert_elems_per_s,
    measure_host_copy_contention,
    measure_host_memory_bytes_per_s,
    measure_matmul_efficiency,
    measure_peak_matmul_flop_per_s,
)
from offload_runtime.hardware.profile import (
    default_cpu_profile,
    measure_hardware,
    profile_hardware,
)

__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY",
    "HOST_ADAM_READS_SPREAD",
    "SWEEP_SIZES_BYTES",
    "AttentionShape",
    "DeviceIdentity",
    "HostStep",
    "HostStepTiming",
    "KernelSteps",
    "MatmulShape",
    "available_host_memory_bytes",
    "default_cache_dir",
    "default_cpu_profile",
    "device_identity",
    "host_adam_median",
    "host_step_configurations",
    "kernel_steps",
    "measure_attention_at",
    "measure_attention_flop_per_s",
    "measure_copy_bandwidth",
    "measure_device_adam_params_per_s",
    "measure_device_memory_bytes_per_s",
    "measure_hardware",
    "measure_host_adam_params_per_s",
    "measure_host_convert_elems_per_s",
    "measure_host_copy_contention",
    "measure_host_memory_bytes_per_s",
    "measure_host_step",
    "measure_host_step_rates",
    "measure_matmul_efficiency",
    "measure_op_overhead_s",
    "measure_peak_matmul_flop_per_s",
    "nvml_handle",
    "profile_hardware",
    "torch_fused_adam_step",
    "total_host_memory_bytes",
    "with_attention_rates",
]
