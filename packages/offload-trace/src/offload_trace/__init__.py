"""offload-trace: trace PyTorch models on the meta device into a costed ModelProfile.

Call :func:`trace` with a model and example inputs; the returned :class:`TracedModel`
holds the graph (for the runtime's rewrites) and converts to the solver's
:class:`offload_solver.ModelProfile` with :meth:`TracedModel.to_profile`.
"""

from offload_trace._costs import OpCost
from offload_trace.errors import TraceError
from offload_trace.traced import TracedModel, device_state_bytes_per_param
from offload_trace.tracer import rewrite_causal_attention, rewrite_tanh_gelu, trace

__all__ = [
    "OpCost",
    "TraceError",
    "TracedModel",
    "device_state_bytes_per_param",
    "rewrite_causal_attention",
    "rewrite_tanh_gelu",
    "trace",
]
