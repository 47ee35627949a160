"""offload-runtime: plan and run parameter offload.

``memory_optimize(model, inputs, memory_budget, solver_name, config=OffloadConfig(...))``
traces the model, measures (or loads) the hardware profile, lets the planner choose every
speed-only option and solve, lays the parameters out in region storage, rewrites the graph
and returns an :class:`OffloadModule` to train; ``plan(...)`` returns the plan alone, and
``describe_plan(plan)`` says what it chose.
``offload_runtime.planning`` holds the expert path (``plan_model`` with ``PlanForce``).
"""

from offload_runtime.api import (
    describe_plan,
    memory_optimize,
    plan,
    plan_summary,
    summary_line,
)
from offload_runtime.config import OffloadConfig
from offload_runtime.controller import OffloadController, RegionState
from offload_runtime.hardware import (
    DeviceIdentity,
    default_cpu_profile,
    device_identity,
    profile_hardware,
)
from offload_runtime.module import OffloadModule
from offload_runtime.passes import (
    apply_plan,
    insert_activation_ops,
    insert_async_ops,
    insert_state_ops,
    insert_sync_ops,
)
from offload_runtime.planning import PlanForce, PlannedModel, build_offload_module, plan_model
from offload_runtime.storage import RegionStorage, region_of

__all__ = [
    "DeviceIdentity",
    "OffloadConfig",
    "OffloadController",
    "OffloadModule",
    "PlanForce",
    "PlannedModel",
    "RegionState",
    "RegionStorage",
    "apply_plan",
    "build_offload_module",
    "default_cpu_profile",
    "describe_plan",
    "device_identity",
    "insert_activation_ops",
    "insert_async_ops",
    "insert_state_ops",
    "insert_sync_ops",
    "memory_optimize",
    "plan",
    "plan_model",
    "plan_summary",
    "profile_hardware",
    "region_of",
    "summary_line",
]
