"""offload-solver: a torch-free planner for parameter offload under a memory budget.

Describe a model as a :class:`ModelProfile` and a machine as a :class:`HardwareProfile`
(its measurements), then call :func:`solve` to get a :class:`Plan`; the simulator's fitted
factors are a :class:`CostModel` (``CostModel()``: the fitted defaults). Nothing here
imports anything outside the Python standard library.
"""

from offload_solver._json import SCHEMA_VERSION, as_bytes, parse_bytes, write_atomic
from offload_solver.cost_model import CostModel
from offload_solver.hardware import BandwidthPoint, HardwareProfile, default_hardware
from offload_solver.host_rates import (
    BF16_MASTER_STATES,
    HOST_STATE_BYTES,
    HOST_STATES,
    HostStepRate,
    default_host_step_rates,
)
from offload_solver.plan import (
    ActivationPlacement,
    MemorySample,
    ParamPlacement,
    Plan,
    PlanOptions,
    Region,
    RegionPlan,
    StatePlacement,
    Stream,
    StreamedStepCosts,
    TimelineInterval,
)
from offload_solver.profile import ModelProfile, Operation, Parameter
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
    "BF16_MASTER_STATES",
    "BUDGET_SAFETY_FACTOR",
    "HOST_STATES",
    "HOST_STATE_BYTES",
    "SCHEMA_VERSION",
    "ActivationPlacement",
    "BandwidthPoint",
    "CostModel",
    "HardwareProfile",
    "HostStepRate",
    "InfeasibleBudgetError",
    "MemorySample",
    "ModelProfile",
    "Operation",
    "ParamPlacement",
    "Parameter",
    "Plan",
    "PlanOptions",
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
    "as_bytes",
    "build_regions",
    "check_speculative_params",
    "default_hardware",
    "default_host_step_rates",
    "get_simulator",
    "get_solver",
    "least_budget_bytes",
    "parse_bytes",
    "search_block_size",
    "simulate",
    "solve",
    "write_atomic",
]
