"""offload-runtime: run an offload plan.

``memory_optimize(model, inputs, memory_budget, solver_name)`` traces the model, measures
(or loads) the hardware profile, solves, lays the parameters out in region storage, rewrites
the graph and returns an :class:`OffloadModule` to train.
"""

from offload_runtime.api import (
    AttentionShape,
    attention_shapes,
    build_offload_module,
    choose_plan,
    device_conversion_profile,
    measure_attention_at,
    measure_device_bytes_in_use,
    memory_optimize,
    plan_summary,
    planning_hardware,
    with_attention_rates,
)
from offload_runtime.controller import OffloadController, RegionState
from offload_runtime.hardware import (
    DeviceIdentity,
    default_cpu_profile,
    device_identity,
    profile_hardware,
)
from offload_runtime.module import OffloadModule
from offload_runtime.passes import apply_plan, insert_async_ops, insert_state_ops, insert_sync_ops
from offload_runtime.storage import RegionStorage, region_of

__all__ = [
    "AttentionShape",
    "DeviceIdentity",
    "OffloadController",
    "OffloadModule",
    "RegionState",
    "RegionStorage",
    "apply_plan",
    "attention_shapes",
    "build_offload_module",
    "choose_plan",
    "default_cpu_profile",
    "device_conversion_profile",
    "device_identity",
    "insert_async_ops",
    "insert_state_ops",
    "insert_sync_ops",
    "measure_attention_at",
    "measure_device_bytes_in_use",
    "memory_optimize",
    "plan_summary",
    "planning_hardware",
    "profile_hardware",
    "region_of",
    "with_attention_rates",
]
