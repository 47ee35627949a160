"""A default machine description for planning without measuring (the CLI's fallback)."""

from __future__ import annotations

from offload_solver.model import BandwidthPoint, HardwareProfile

GiB = 2**30


def default_hardware() -> HardwareProfile:
    """A PCIe Gen5 x16 H200-like machine, for planning without measuring; a run on real
    hardware plans with ``offload_runtime.profile_hardware``'s measurements instead.

    - Pinned copies: 55 GB/s from 16 MB up in both directions, 42 GB/s (H2D) and 48 GB/s
      (D2H) at 1 MB; below 1 MB copies are latency-bound (the 4 KiB and 64 KiB points
      assume about 8 us and 10 us per copy).
    - fp16 matrix multiply peak 740 TFLOP/s with efficiency 0.3: a training step mixes
      small matrix products with memory-bound operations, so most of the peak is out of
      reach.
    - 140 GiB device memory, 128 GiB host memory.
    - Host Adam 4.4e9 parameters/s (fused CPU Adam); device Adam 50e9/s.
    - Host fp16 <-> fp32 conversion 11e9 elements/s.
    - No per-operation issue cost (``op_overhead_s`` 0): it depends on the host's Python
      speed, so only a measured profile has one.
    - Device memory 4.2e12 bytes/s read plus written: memory-bound operations take at
      least their traffic over it.
    - Fused host Adam keeps 0.55 of its standalone rate while pinned copies run both ways
      at once (``host_copy_contention``).
    """
    return HardwareProfile(
        name="default-h200-pcie5",
        h2d=(
            BandwidthPoint(4 * 2**10, 0.5e9),
            BandwidthPoint(64 * 2**10, 6.5e9),
            BandwidthPoint(10**6, 42e9),
            BandwidthPoint(16 * 10**6, 54e9),
            BandwidthPoint(256 * 10**6, 55e9),
            BandwidthPoint(10**9, 55e9),
        ),
        d2h=(
            BandwidthPoint(4 * 2**10, 0.5e9),
            BandwidthPoint(64 * 2**10, 6.5e9),
            BandwidthPoint(10**6, 48e9),
            BandwidthPoint(16 * 10**6, 54e9),
            BandwidthPoint(256 * 10**6, 55e9),
            BandwidthPoint(10**9, 54e9),
        ),
        compute_flop_per_s=740e12,
        compute_efficiency=0.3,
        device_memory_bytes=140 * GiB,
        host_memory_bytes=128 * GiB,
        host_adam_params_per_s=4.4e9,
        device_adam_params_per_s=50e9,
        host_convert_elems_per_s=11e9,
        device_memory_bytes_per_s=4.2e12,
        host_copy_contention=0.55,
    )


__all__ = ["default_hardware"]
