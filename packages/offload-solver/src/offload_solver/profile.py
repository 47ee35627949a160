"""What a model costs: its parameters and operations (``ModelProfile``) and their JSON.

Every record here is a frozen dataclass of plain numbers and strings, with units in the
field names (``_bytes``, ``_flop``), so that any framework can build them and the solver
never sees a framework object (``offload_trace`` writes them for PyTorch models).

[Note: memory model]
The simulator accounts device memory as the sum of
- parameters in the training dtype (``Parameter.size_bytes``) of every region that is on
  the device at that moment (resident regions always, offloaded ones while in use);
- per-parameter optimizer bytes (``ModelProfile.device_state_bytes_per_param``: master
  weights, Adam moments and the full-precision gradient accumulator) of every trainable
  parameter (``Parameter.trainable``) of a region whose optimizer state the plan keeps on
  the device;
- gradients in the training dtype of the trainable parameters of host-state regions, from
  the end of that region's backward until their copy to the host completes;
- activations: for operation ``i`` in forward, the saved bytes of operations ``< i``,
  plus ``fwd_out_bytes`` and ``fwd_tmp_bytes`` of ``i``; in backward, the saved bytes of
  operations ``<= i`` not yet released, plus ``bwd_out_bytes`` and ``bwd_tmp_bytes`` of
  ``i``. After operation ``i``'s backward its ``saved_bytes`` are released.
A profiler fills ``fwd_tmp_bytes`` / ``bwd_tmp_bytes`` with whatever else is alive at that
point (inputs still needed by later operations, workspaces, incoming gradients), so that
the formula above gives the true live bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from offload_solver._json import (
    SCHEMA_VERSION,
    check_numbers,
    get_field,
    load_document,
    record,
    str_list,
    to_jsonable,
)


@dataclass(frozen=True)
class Parameter:
    """One named parameter of the model.

    Members of a tied group are each listed with the same ``numel`` / ``size_bytes``; the
    solver counts the group's storage once.
    """

    name: str
    numel: int
    """Number of elements."""
    size_bytes: int
    """Bytes in the training dtype on the device (``numel`` x element size)."""
    trainable: bool = True
    """Whether training updates it (``requires_grad``). A frozen parameter (a LoRA
    fine-tune's base weights) has no gradient and no optimizer state: the solver prices
    its storage and uploads like any parameter's, but no gradient copy, optimizer state or
    optimizer step for it. Members of a tied group share one storage and must agree."""


@dataclass(frozen=True)
class Operation:
    """One operation of the forward pass, in execution order.

    ``name`` is unique within the profile; a tracer uses the graph node's name so that a
    plan can be mapped back onto the graph.
    """

    name: str
    param_names: tuple[str, ...] = ()
    """Parameters the operation reads directly (any member of a tied group may appear)."""
    fwd_out_bytes: int = 0
    """Bytes of the operation's outputs."""
    fwd_tmp_bytes: int = 0
    """Other bytes alive while it runs forward (see the memory model note)."""
    saved_bytes: int = 0
    """Bytes kept from its forward until its backward (storages counted once, parameter
    aliases left out)."""
    bwd_tmp_bytes: int = 0
    """Other bytes alive while its backward runs (incoming gradients, workspaces)."""
    bwd_out_bytes: int = 0
    """Bytes of the gradients its backward produces for its inputs."""
    fwd_flop: int = 0
    bwd_flop: int = 0
    attention: bool = False
    """A fused attention operation (scaled dot-product attention): priced at the
    hardware's attention rates where known (``HardwareProfile.attention_fwd_flop_per_s``),
    which can be well under the matrix-multiply rate."""
    mutates: bool = False
    """The operation writes in place into one of its inputs: a region holding one never
    recomputes its activations (``ActivationPlacement.RECOMPUTE``), since the second run
    could read a value the first one changed; it may send them to the host."""
    out_storage_bytes: tuple[int, ...] = ()
    """Bytes of each storage its forward allocates that is alive when it returns, in
    order (together ``fwd_out_bytes``). Numbered across the profile in operation order
    (the first operation's first storage is 0), these are the storages ``reads`` names."""
    reads: tuple[int, ...] = ()
    """The activation storages its forward reads, by their numbers (see
    ``out_storage_bytes``); parameters, buffers and the model's inputs have none. A
    RECOMPUTE region holds the storages its operations read from before it until its
    backward ([Note: activations] in ``offload_solver.simulators._activations``); a
    profile without reads has that approximated."""

    @property
    def fwd_traffic_bytes(self) -> int:
        """Estimated device-memory bytes its forward reads and writes (see
        [Note: memory-bound operations])."""
        return FWD_TRAFFIC_FACTOR * self.fwd_out_bytes

    @property
    def bwd_traffic_bytes(self) -> int:
        """Estimated device-memory bytes its backward reads and writes."""
        return BWD_TRAFFIC_FACTOR * self.bwd_out_bytes


# [Note: memory-bound operations]
# An operation's time is the largest of its compute (FLOPs over the achieved matmul
# rate), its device-memory traffic over the device's memory bandwidth, and the cost of
# issuing it. Element-wise operations, layer norms and dropout have next to no FLOPs but
# move every byte of their activations, a sizeable share of a step that a FLOP count
# alone would miss. The profile records the bytes an operation
# allocates, not what it reads, so traffic is estimated from outputs: a forward reads
# inputs of about its output's size and writes the output (2x); a backward reads the
# incoming gradient and a saved input and writes the input's gradient (3x). Views
# allocate nothing and cost nothing; for matrix products the compute term dominates.
FWD_TRAFFIC_FACTOR = 2
BWD_TRAFFIC_FACTOR = 3


@dataclass(frozen=True)
class ModelProfile:
    """A model as the solver sees it: parameters, operations and tied groups."""

    name: str
    parameters: tuple[Parameter, ...]
    operations: tuple[Operation, ...]
    tied_groups: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names sharing one storage; the first member owns it."""
    device_state_bytes_per_param: int = 16
    """Device bytes per parameter element when a region's optimizer state lives on the
    device: fp32 master (4) + Adam moments (8) + fp32 gradient (4) for fp16/bf16 training."""
    host_grad_bytes_per_param: int = 2
    """Bytes per parameter element copied device-to-host as a gradient: the training dtype's
    size, or 4 for a runtime that widens gradients to fp32 on the device before the copy
    (the offload runtime's ``convert_on_device`` option)."""
    host_upload_bytes_per_param: int = 0
    """Bytes per parameter element that an upload of a host-state region's parameters
    moves host-to-device (sync upload, prefetch, and the post-step upload of a resident
    region). 0 means the parameters' own size (``Parameter.size_bytes``): the runtime
    uploads the training-dtype copy that the host published after its Adam step. 4 means
    the runtime uploads the fp32 master weights and narrows them on the device, so the
    host makes no publish pass (see [Note: step model] in
    ``offload_solver.simulators._engine``)."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        validate_profile(self)

    @property
    def parameter_map(self) -> dict[str, Parameter]:
        return {p.name: p for p in self.parameters}

    def canonical_names(self) -> dict[str, str]:
        """Map every parameter name to the owner of its storage (itself when untied)."""
        out = {p.name: p.name for p in self.parameters}
        for group in self.tied_groups:
            for member in group:
                out[member] = group[0]
        return out

    @property
    def total_param_bytes(self) -> int:
        """Parameter bytes in the training dtype, tied storage counted once."""
        canon = self.canonical_names()
        return sum(p.size_bytes for p in self.parameters if canon[p.name] == p.name)

    @property
    def total_param_numel(self) -> int:
        canon = self.canonical_names()
        return sum(p.numel for p in self.parameters if canon[p.name] == p.name)

    @property
    def trainable_param_numel(self) -> int:
        """Elements of the trainable parameters (the ones with optimizer state), tied
        storage counted once."""
        canon = self.canonical_names()
        return sum(p.numel for p in self.parameters if canon[p.name] == p.name and p.trainable)

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        data = load_document(text, "ModelProfile")
        try:
            return ModelProfile(
                name=get_field(data, "name", str),
                parameters=tuple(
                    record(Parameter, p, f"parameters[{i}]")
                    for i, p in enumerate(get_field(data, "parameters", list))
                ),
                operations=tuple(
                    record(Operation, o, f"operations[{i}]")
                    for i, o in enumerate(get_field(data, "operations", list))
                ),
                tied_groups=tuple(
                    tuple(str_list(g, f"tied_groups[{i}]"))
                    for i, g in enumerate(data.get("tied_groups", []))
                ),
                device_state_bytes_per_param=get_field(
                    data, "device_state_bytes_per_param", int, default=16
                ),
                host_grad_bytes_per_param=get_field(
                    data, "host_grad_bytes_per_param", int, default=2
                ),
                host_upload_bytes_per_param=get_field(
                    data, "host_upload_bytes_per_param", int, default=0
                ),
            )
        except TypeError as exc:  # a field of the wrong JSON type deep in a record
            raise ValueError(f"malformed ModelProfile JSON: {exc}") from exc


def validate_profile(profile: ModelProfile) -> None:
    """Raise ``ValueError`` naming the field when the profile is inconsistent."""
    if profile.schema_version != SCHEMA_VERSION:
        raise ValueError(
            f"ModelProfile.schema_version is {profile.schema_version}; "
            f"this solver reads version {SCHEMA_VERSION}"
        )
    if not profile.operations:
        raise ValueError("ModelProfile.operations is empty: the model has no operations")
    names: set[str] = set()
    for p in profile.parameters:
        if p.name in names:
            raise ValueError(f"ModelProfile.parameters: duplicate parameter name {p.name!r}")
        names.add(p.name)
        for key in ("numel", "size_bytes"):
            value = getattr(p, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"ModelProfile.parameters ({p.name!r}).{key} is {value!r}; must be a "
                    "whole number >= 0"
                )
        if p.numel and not (p.size_bytes % p.numel == 0 and 1 <= p.size_bytes // p.numel <= 8):
            raise ValueError(
                f"ModelProfile.parameters ({p.name!r}): size_bytes {p.size_bytes} is not "
                f"numel {p.numel} times an element size of 1 to 8 bytes"
            )
        if not isinstance(p.trainable, bool):
            raise ValueError(
                f"ModelProfile.parameters ({p.name!r}).trainable is {p.trainable!r}; must be "
                "true or false"
            )
    op_names: set[str] = set()
    for i, op in enumerate(profile.operations):
        if op.name in op_names:
            raise ValueError(f"ModelProfile.operations[{i}]: duplicate operation name {op.name!r}")
        op_names.add(op.name)
        for pname in op.param_names:
            if pname not in names:
                raise ValueError(
                    f"ModelProfile.operations[{i}] ({op.name!r}) uses unknown parameter "
                    f"{pname!r}; add it to ModelProfile.parameters"
                )
        check_numbers(op, f"ModelProfile.operations[{i}] ({op.name!r})")
    seen: set[str] = set()
    for gi, group in enumerate(profile.tied_groups):
        if len(group) < 2:
            raise ValueError(f"ModelProfile.tied_groups[{gi}] has fewer than two members")
        sizes = set()
        trainable = set()
        for member in group:
            if member not in names:
                raise ValueError(
                    f"ModelProfile.tied_groups[{gi}] names unknown parameter {member!r}"
                )
            if member in seen:
                raise ValueError(
                    f"ModelProfile.tied_groups: parameter {member!r} is in more than one group"
                )
            seen.add(member)
            sizes.add(profile.parameter_map[member].size_bytes)
            trainable.add(profile.parameter_map[member].trainable)
        if len(sizes) != 1:
            raise ValueError(
                f"ModelProfile.tied_groups[{gi}] members have different sizes {sorted(sizes)}"
            )
        if len(trainable) != 1:
            raise ValueError(
                f"ModelProfile.tied_groups[{gi}] mixes trainable and frozen members; tied "
                "parameters share one storage"
            )
    check_numbers(profile, "ModelProfile")


__all__ = [
    "BWD_TRAFFIC_FACTOR",
    "FWD_TRAFFIC_FACTOR",
    "ModelProfile",
    "Operation",
    "Parameter",
    "validate_profile",
]
