"""offload-solver: a torch-free planner for parameter offload under a memory budget.

Describe a model as a :class:`ModelProfile` and a machine as a :class:`HardwareProfile`,
then call :func:`solve` to get a :class:`Plan`. Nothing here imports anything outside the
Python standard library.
"""

from offload_solver.hardware import default_hardware
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
    StreamedStepCosts,
    TimelineInterval,
    parse_bytes,
)
from offload_solver.regions import RegionLayout, build_regions, search_block_size
from offload_solver.simulators import (
    RegionAssignment,
    SimulationContext,
    SimulationResult,
    check_speculative_params,
    get_simulator,
    simulate,
)
from offload_solver.solve import (
    BUDGET_SAFETY_FACTOR,
    InfeasibleBudgetError,
    least_budget_bytes,
    solve,
)
from offload_solver.solvers import get_solver

__all__ = [
    "BUDGET_SAFETY_FACTOR",
    "SCHEMA_VERSION",
    "BandwidthPoint",
    "HardwareProfile",
    "InfeasibleBudgetError",
    "MemorySample",
    "ModelProfile",
    "Operation",
    "ParamPlacement",
    "Parameter",
    "Plan",
    "Region",
    "RegionAssignment",
    "RegionLayout",
    "RegionPlan",
    "SimulationContext",
    "SimulationResult",
    "StatePlacement",
    "Stream",
    "StreamedStepCosts",
    "TimelineInterval",
    "build_regions",
    "check_speculative_params",
    "default_hardware",
    "get_simulator",
    "get_solver",
    "least_budget_bytes",
    "parse_bytes",
    "search_block_size",
    "simulate",
    "solve",
]
