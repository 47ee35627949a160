"""offload-solver: a torch-free planner for parameter offload under a memory budget.

Describe a model as a :class:`ModelProfile` and a machine as a :class:`HardwareProfile`,
then call :func:`solve` to get a :class:`Plan`. Nothing here imports anything outside the
Python standard library.
"""

from offload_solver.model import (
    SCHEMA_VERSION,
    BandwidthPoint,
    HardwareProfile,
    MemorySample,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    Region,
    RegionPlan,
    StatePlacement,
    Stream,
    TimelineInterval,
    parse_bytes,
)

__all__ = [
    "SCHEMA_VERSION",
    "BandwidthPoint",
    "HardwareProfile",
    "MemorySample",
    "ModelProfile",
    "Operation",
    "ParamPlacement",
    "Parameter",
    "Plan",
    "Region",
    "RegionPlan",
    "StatePlacement",
    "Stream",
    "TimelineInterval",
    "parse_bytes",
]
