"""The cost model: the factors the simulator assumes beyond what was measured.

A :class:`~offload_solver.hardware.HardwareProfile` holds measurements of one machine. Part
of what a training step costs is measured by no probe: how much slower the host issues the
backward while gradient hooks and host Adam threads run beside it, how fast the streamed
ring's copies go up beside host Adam. Those factors are fitted instead: benchmark rows
recorded on a GPU are replayed through the simulator at candidate values, and the value
under which the most rows predict their measured step within 15% is kept
(``python benchmarks/replay_bench.py ROWS --hold-plan ...``). They live here, apart from
the measurements, and a plan records the cost model it was made with (``Plan.cost_model``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from offload_solver._json import SCHEMA_VERSION, get_field, load_document, record


@dataclass(frozen=True)
class CostModel:
    """The simulator's fitted factors; ``CostModel()`` holds the fitted defaults, which
    ``solve`` and ``offload_runtime.memory_optimize`` plan with unless told otherwise."""

    backward_issue_factor: float = 4.0
    """How many times ``HardwareProfile.op_overhead_s`` each backward operation costs the
    host to issue in a step with host-state (HOST or STREAMED) regions, whose gradient
    hooks and host Adam threads run beside the backward; that backward is then simulated
    as issued ahead of the device where that takes longer than the backward priced alone
    ([Note: the backward beside the host] in ``offload_solver.simulators._context``). A
    finite factor >= 1; 1 issues that backward as any other pass. Default 4.0
    (BENCHMARKS.md, Decisions, "The backward beside the host"). Fitted by
    ``python benchmarks/replay_bench.py ROWS --hold-plan --host-rate samples
    --backward-issue-factor F`` over candidate factors F; ``offload_optim``'s
    ``check_backward_issue`` reads the factor one training loop shows."""
    stream_up_fraction: float = 0.78
    """Fraction of the pinned host-to-device rate (``HardwareProfile.h2d``) that a STREAMED
    step's state copies up reach: they run beside the host steps of other regions and the
    ring's copies down, which share host memory with them ([Note: streamed steps] in
    ``offload_solver.simulators._engine``). In (0, 1]; 1: the profiled rate. Only STREAMED
    regions use it. Default 0.78, fitted together with ``stream_host_charge``
    (BENCHMARKS.md, Decisions, "Streamed host state") by ``python
    benchmarks/replay_bench.py ROWS --hold-plan --stream-up-fraction F
    --stream-host-charge S`` over candidate pairs; ``offload_optim``'s
    ``check_stream_rate`` reads the fraction one training loop shows."""
    stream_host_charge: float = 0.5
    """Share of the ``HardwareProfile.host_copy_contention`` charge that a STREAMED
    region's pinned copies of the step put on the host lane ([Note: streamed steps]). In
    [0, 1]; 1 charges them as a host-state region's own copies, all of the contention on
    the host. Host Adam and the ring's copies both slow down where they share host memory,
    so a share below 1, with ``stream_up_fraction`` below 1, splits the contention between
    the two. Only STREAMED regions use it. Default 0.5, fitted with
    ``stream_up_fraction`` by the same command."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"CostModel.{f.name} is {value!r}; it must be a number")
        if not 1 <= self.backward_issue_factor < math.inf:
            raise ValueError(
                f"CostModel.backward_issue_factor is {self.backward_issue_factor}; it must "
                "be a finite factor >= 1 (1: the backward issues as any pass does)"
            )
        if not 0 < self.stream_up_fraction <= 1:
            raise ValueError(
                f"CostModel.stream_up_fraction is {self.stream_up_fraction}; it must be in "
                "(0, 1] (1: the profiled H2D rate)"
            )
        if not 0 <= self.stream_host_charge <= 1:
            raise ValueError(
                f"CostModel.stream_host_charge is {self.stream_host_charge}; it must be in "
                "[0, 1] (1 charges the host in full)"
            )

    def to_json(self) -> str:
        return json.dumps({"schema_version": SCHEMA_VERSION, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostModel:
        """Read a cost model written by :meth:`to_json`; a factor the document lacks takes
        its default, and a key that names no factor is an error (a misspelt factor would
        otherwise plan at the default unnoticed)."""
        data = load_document(text, "CostModel")
        return record(cls, {k: v for k, v in data.items() if k != "schema_version"}, "CostModel")

    @classmethod
    def from_hardware_json(cls, text: str) -> CostModel:
        """The cost model a ``HardwareProfile`` document written before the cost model had
        a record of its own planned with: the factors it carries, and 1 (what a profile
        held when the factor was not set) for each one it lacks. For documents such as
        the hardware recorded in benchmark rows, which ``HardwareProfile.from_json`` reads
        without these factors."""
        data = load_document(text, "HardwareProfile")
        return cls(
            **{
                name: float(get_field(data, name, (int, float), default=1.0))
                for name in COST_MODEL_FIELDS
            }
        )


COST_MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CostModel))
"""The names of :class:`CostModel`'s factors."""


__all__ = ["COST_MODEL_FIELDS", "CostModel"]
