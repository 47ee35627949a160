"""The solver's data model, one module per record (this module re-exports them):

- ``profile.py``: what a model costs, ``ModelProfile`` (``Parameter``, ``Operation``),
  with [Note: memory model] (the device bytes the simulator counts) and [Note:
  memory-bound operations];
- ``hardware.py``: what a machine can move and compute, as measured (``HardwareProfile``,
  ``BandwidthPoint``), and ``default_hardware()``;
- ``cost_model.py``: the simulator's fitted factors (``CostModel``);
- ``plan.py``: the solver's answer (``Plan``, ``RegionPlan``, the placements,
  ``StreamedStepCosts``);
- ``_json.py``: the JSON helpers every record uses, and ``parse_bytes``.
"""

from __future__ import annotations

from offload_solver._json import SCHEMA_VERSION, parse_bytes
from offload_solver.cost_model import CostModel
from offload_solver.hardware import BandwidthPoint, HardwareProfile
from offload_solver.plan import (
    MemorySample,
    ParamPlacement,
    Plan,
    Region,
    RegionPlan,
    StatePlacement,
    Stream,
    StreamedStepCosts,
    TimelineInterval,
)
from offload_solver.profile import ModelProfile, Operation, Parameter, validate_profile

__all__ = [
    "SCHEMA_VERSION",
    "BandwidthPoint",
    "CostModel",
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
    "StreamedStepCosts",
    "TimelineInterval",
    "parse_bytes",
    "validate_profile",
]
