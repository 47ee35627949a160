"""Errors raised by :func:`offload_trace.trace`."""

from __future__ import annotations


class TraceError(RuntimeError):
    """The model could not be traced or costed.

    The message names the module or operation that failed, the underlying cause and what
    to try instead.
    """
