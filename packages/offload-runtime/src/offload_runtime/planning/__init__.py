"""Planning: from a model, its inputs and a budget to a plan whose options the runtime and
the optimizer execute. By job:

- ``planner.py``: :func:`plan_model` (trace, measure, solve the candidates, keep the
  fastest) and :func:`build_offload_module`;
- ``candidates.py``: the configurations solved and what each costs ([Note: the planner's
  candidates]);
- ``force.py``: :class:`PlanForce`, choices fixed by tests, the benchmark and experts;
- ``speculation.py``: how many parameters' undo buffers fit in host memory;
- ``streamed_costs.py``: what a streamed region's ring moves and holds;
- ``attention.py``: the traced model's fused attention shapes, and whether the plan
  prices them at measured rates;
- ``device.py``: device bytes in use, the model's own bytes on a device, the traced
  model's matrix products.
"""

from offload_runtime.hardware.attention import (
    AttentionShape,
    measure_attention_at,
    with_attention_rates,
)
from offload_runtime.planning.attention import attention_shapes
from offload_runtime.planning.candidates import Candidate, candidates
from offload_runtime.planning.device import (
    matmul_shapes,
    measure_device_bytes_in_use,
    model_bytes_on,
)
from offload_runtime.planning.force import PlanForce
from offload_runtime.planning.planner import (
    PlannedModel,
    build_offload_module,
    device_conversion_profile,
    plan_model,
)
from offload_runtime.planning.speculation import (
    SPECULATION_HOST_SHARE,
    speculative_params_that_fit,
)
from offload_runtime.planning.streamed_costs import (
    stream_copy_bytes,
    stream_slot_bytes,
    streamed_step_costs,
)

__all__ = [
    "SPECULATION_HOST_SHARE",
    "AttentionShape",
    "Candidate",
    "PlanForce",
    "PlannedModel",
    "attention_shapes",
    "build_offload_module",
    "candidates",
    "device_conversion_profile",
    "matmul_shapes",
    "measure_attention_at",
    "measure_device_bytes_in_use",
    "model_bytes_on",
    "plan_model",
    "speculative_params_that_fit",
    "stream_copy_bytes",
    "stream_slot_bytes",
    "streamed_step_costs",
    "with_attention_rates",
]
