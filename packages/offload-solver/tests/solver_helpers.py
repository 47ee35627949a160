"""Shared test helpers: random profiles and assignments, and a brute-force reference
simulator written independently of the fast engine (per operation, every memory level
summed from scratch, coexistence by pairwise checks)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from offload_solver import (
    BandwidthPoint,
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    RegionAssignment,
    StatePlacement,
)
from offload_solver.regions import RegionLayout


def flat_hardware(
    h2d_bytes_per_s: float = 1000.0,
    d2h_bytes_per_s: float = 1000.0,
    flop_per_s: float = 1000.0,
    host_adam_params_per_s: float = 1000.0,
    device_adam_params_per_s: float = 1e6,
    host_convert_elems_per_s: float = 0.0,
) -> HardwareProfile:
    """A machine with size-independent copy rates, for hand arithmetic."""
    return HardwareProfile(
        name="flat",
        h2d=(BandwidthPoint(1, h2d_bytes_per_s),),
        d2h=(BandwidthPoint(1, d2h_bytes_per_s),),
        compute_flop_per_s=flop_per_s,
        compute_efficiency=1.0,
        device_memory_bytes=2**40,
        host_memory_bytes=2**40,
        host_adam_params_per_s=host_adam_params_per_s,
        device_adam_params_per_s=device_adam_params_per_s,
        host_convert_elems_per_s=host_convert_elems_per_s,
    )


@st.composite
def hardware_profiles(draw: st.DrawFn) -> HardwareProfile:
    """Flat machines whose rates are powers of two: every duration is then an exact binary
    fraction, so events that coincide in exact arithmetic coincide in floats too and the
    engine and the reference (which add times up in different orders) agree on ties."""
    return flat_hardware(
        h2d_bytes_per_s=draw(st.sampled_from([64.0, 1024.0, 8192.0])),
        d2h_bytes_per_s=draw(st.sampled_from([64.0, 1024.0, 8192.0])),
        flop_per_s=draw(st.sampled_from([64.0, 1024.0, 8192.0])),
        host_adam_params_per_s=draw(st.sampled_from([8.0, 128.0, 8192.0])),
        device_adam_params_per_s=draw(st.sampled_from([1024.0, 2.0**20])),
        host_convert_elems_per_s=draw(st.sampled_from([0.0, 16.0, 256.0, 8192.0])),
    )


@st.composite
def profiles(
    draw: st.DrawFn, max_params: int = 7, max_ops: int = 14, max_act_bytes: int = 300
) -> ModelProfile:
    """Random small profiles: parameters, tied groups of any size, operations using them."""
    n_base = draw(st.integers(0, max_params))
    params: list[Parameter] = []
    groups: list[tuple[str, ...]] = []
    for i in range(n_base):
        numel = draw(st.integers(0, 400))
        elem = draw(st.sampled_from([1, 2, 4]))
        params.append(Parameter(f"p{i}", numel, numel * elem))
        n_tied = draw(st.integers(0, 2)) if draw(st.booleans()) else 0
        if n_tied:
            members = [f"p{i}"] + [f"p{i}_tie{k}" for k in range(n_tied)]
            for m in members[1:]:
                params.append(Parameter(m, numel, numel * elem))
            groups.append(tuple(draw(st.permutations(members))))
    names = [p.name for p in params]
    n_ops = draw(st.integers(1, max_ops))
    ops = []
    small = st.integers(0, max_act_bytes)
    for j in range(n_ops):
        uses = tuple(draw(st.lists(st.sampled_from(names), max_size=2))) if names else ()
        ops.append(
            Operation(
                name=f"op{j}",
                param_names=uses,
                fwd_out_bytes=draw(small),
                fwd_tmp_bytes=draw(small),
                saved_bytes=draw(small),
                bwd_tmp_bytes=draw(small),
                bwd_out_bytes=draw(small),
                fwd_flop=draw(st.sampled_from([0, 10, 100, 1000, 5000])),
                bwd_flop=draw(st.sampled_from([0, 20, 200, 2000, 10000])),
            )
        )
    return ModelProfile(
        name="random",
        parameters=tuple(params),
        operations=tuple(ops),
        tied_groups=tuple(groups),
        device_state_bytes_per_param=draw(st.sampled_from([0, 8, 16])),
        host_grad_bytes_per_param=draw(st.sampled_from([0, 2, 4])),
        host_upload_bytes_per_param=draw(st.sampled_from([0, 2, 4])),
    )


@st.composite
def layered_profiles(draw: st.DrawFn) -> ModelProfile:
    """Profiles shaped like a network: each parameter is used by a few consecutive
    operations, so most regions can be offloaded; optionally a tied embedding/head pair."""
    n_layers = draw(st.integers(2, 12))
    params = [Parameter("emb", 50, 100)]
    ops = [Operation("emb", ("emb",), fwd_out_bytes=draw(st.integers(0, 40)), saved_bytes=5)]
    small = st.integers(0, 40)
    for i in range(n_layers):
        numel = draw(st.integers(1, 300))
        params.append(Parameter(f"w{i}", numel, 2 * numel))
        for k in range(draw(st.integers(1, 3))):
            ops.append(
                Operation(
                    f"l{i}_{k}",
                    (f"w{i}",) if k == 0 else (),
                    fwd_out_bytes=draw(small),
                    fwd_tmp_bytes=draw(small),
                    saved_bytes=draw(small),
                    bwd_tmp_bytes=draw(small),
                    bwd_out_bytes=draw(small),
                    fwd_flop=draw(st.sampled_from([0, 100, 1000, 5000])),
                    bwd_flop=draw(st.sampled_from([0, 200, 2000, 10000])),
                )
            )
    tied = draw(st.booleans())
    if tied:
        params.append(Parameter("head", 50, 100))
    ops.append(Operation("head", ("head",) if tied else ("emb",), fwd_flop=100, bwd_flop=200))
    return ModelProfile(
        name="layered",
        parameters=tuple(params),
        operations=tuple(ops),
        tied_groups=(("emb", "head"),) if tied else (),
        host_grad_bytes_per_param=draw(st.sampled_from([0, 2])),
        host_upload_bytes_per_param=draw(st.sampled_from([0, 4])),
    )


@st.composite
def assignments(draw: st.DrawFn, layout: RegionLayout) -> list[RegionAssignment]:
    """A random valid assignment for ``layout``."""
    regions = layout.regions
    n = len(regions)
    out = []
    for r, reg in enumerate(regions):
        choices = [ParamPlacement.RESIDENT]
        if not reg.pinned:
            choices.append(ParamPlacement.SYNC)
            if r < n - 1:
                choices.append(ParamPlacement.ASYNC)
        placement = draw(st.sampled_from(choices))
        if placement is ParamPlacement.RESIDENT:
            state = draw(st.sampled_from(list(StatePlacement)))
        else:
            state = StatePlacement.HOST
        prefetch = draw(st.integers(r + 1, n - 1)) if placement is ParamPlacement.ASYNC else None
        out.append(RegionAssignment(placement, state, prefetch))
    return out


# --------------------------------------------------------------------------------------
# Reference simulator
# --------------------------------------------------------------------------------------


@dataclass
class ReferenceResult:
    step_time_s: float
    peak_bytes: int
    raw_peak_bytes: int
    coexisting: set[tuple[int, int]]
    num_blocks: int
    lifetimes: dict[int, list[tuple[float, float]]]


def reference_simulate(
    profile: ModelProfile,
    hardware: HardwareProfile,
    layout: RegionLayout,
    assignment: list[RegionAssignment],
    *,
    host_step_after_backward: bool = False,
) -> ReferenceResult:
    """The step model of the issue, simulated operation by operation, memory by brute force.

    Host work per host-state region, on one FIFO worker: widen the copied gradients
    (unless they cross as fp32 or not at all), the overflow/norm partial when the step waits
    for backward, Adam, publish (none when fp32 masters are uploaded); conversions cost
    ``numel / host_convert_elems_per_s``. Uploads move ``size_bytes``, or ``numel *
    host_upload_bytes_per_param`` when that is set.
    """
    rate = hardware.host_convert_elems_per_s

    def convert(numel: int) -> float:
        return numel / rate if rate > 0 else 0.0

    widens = profile.host_grad_bytes_per_param in (1, 2, 3)
    regions = layout.regions
    ops = profile.operations
    n = len(regions)
    place = [a.placement for a in assignment]
    on_dev = [a.state is StatePlacement.DEVICE for a in assignment]
    offl = [p is not ParamPlacement.RESIDENT for p in place]

    def up(r: int) -> float:
        # Every upload is of a host-state region: its training-dtype bytes, or what the
        # runtime sends per element (4: fp32 masters narrowed on the device).
        per_elem = profile.host_upload_bytes_per_param
        nbytes = regions[r].numel * per_elem if per_elem else regions[r].size_bytes
        return hardware.h2d_time_s(nbytes)

    def publish(numel: int) -> float:
        return 0.0 if profile.host_upload_bytes_per_param >= 4 else convert(numel)

    t = 0.0
    h2d = 0.0
    pf_issue: dict[tuple[str, int], float] = {}
    pf_end: dict[tuple[str, int], float] = {}
    life: dict[int, list[tuple[float, float]]] = {r: [] for r in range(n) if offl[r]}
    fwd_op_start: dict[int, float] = {}
    bwd_op_start: dict[int, float] = {}

    def prefetch(tag: str, r: int, issue: float) -> None:
        nonlocal h2d
        s = max(issue, h2d)
        h2d = s + up(r)
        pf_issue[tag, r], pf_end[tag, r] = issue, h2d

    if place[0] is ParamPlacement.ASYNC:
        prefetch("f", 0, 0.0)
    for r, reg in enumerate(regions):
        reach = t
        if r + 1 < n and place[r + 1] is ParamPlacement.ASYNC:
            prefetch("f", r + 1, reach)
        acquired = reach
        if place[r] is ParamPlacement.SYNC:
            t += up(r)
        elif place[r] is ParamPlacement.ASYNC:
            acquired = pf_issue["f", r]
            t = max(t, pf_end["f", r])
        for j in range(reg.op_start, reg.op_end):
            fwd_op_start[j] = t
            t += hardware.compute_time_s(ops[j].fwd_flop)
        if offl[r]:
            life[r].append((acquired, t))

    d2h = 0.0
    host = 0.0
    pending: list[tuple[float, int]] = []
    waiting: list[int] = []  # regions whose host step waits for the end of backward
    grads: list[tuple[int, float, float, int]] = []  # (region, added, copied, bytes)
    region_end: dict[int, float] = {}
    for r in range(n - 1, -1, -1):
        reg = regions[r]
        reach = t
        while pending and pending[0][0] <= reach:
            issue, q = pending.pop(0)
            s = max(issue, h2d)
            h2d = s + up(q)
        for i in range(n - 1, -1, -1):
            if place[i] is ParamPlacement.ASYNC and assignment[i].prefetch_at == r:
                prefetch("b", i, reach)
        acquired = reach
        if place[r] is ParamPlacement.SYNC:
            t += up(r)
        elif place[r] is ParamPlacement.ASYNC:
            acquired = pf_issue["b", r]
            t = max(t, pf_end["b", r])
        for j in range(reg.op_end - 1, reg.op_start - 1, -1):
            bwd_op_start[j] = t
            t += hardware.compute_time_s(ops[j].bwd_flop)
        region_end[r] = t
        if offl[r]:
            life[r].append((acquired, t))
        if not on_dev[r] and reg.numel > 0:
            s = max(t, d2h)
            d2h = s + hardware.d2h_time_s(reg.numel * profile.host_grad_bytes_per_param)
            if d2h > t and reg.size_bytes:
                grads.append((r, t, d2h, reg.size_bytes))
            # Gradient work starts as the copy lands, whether or not the step waits.
            host = max(d2h, host)
            if widens:
                host += convert(reg.numel)
            if host_step_after_backward:
                host += convert(reg.numel)
                waiting.append(r)
                continue
            host += reg.numel / hardware.host_adam_params_per_s + publish(reg.numel)
            if not offl[r]:
                pending.append((host, r))
    # Steps that waited for the global answer: after backward, in forward order.
    for r in sorted(waiting):
        host = max(host, t)
        host += regions[r].numel / hardware.host_adam_params_per_s + publish(regions[r].numel)
        if not offl[r]:
            pending.append((host, r))
    for issue, q in pending:
        s = max(issue, h2d)
        h2d = s + up(q)
    for r in range(n):
        if on_dev[r]:
            t += regions[r].numel / hardware.device_adam_params_per_s
    step = max(t, h2d, d2h, host)

    # Pool: pairwise coexistence, then first fit in region order.
    held = {r: [(s, e) for s, e in ivs if e > s] for r, ivs in life.items()}
    pairs = set()
    for a in held:
        for b in held:
            if a < b and any(s1 < e2 and s2 < e1 for s1, e1 in held[a] for s2, e2 in held[b]):
                pairs.add((a, b))
    block: dict[int, int] = {}
    for r in sorted(life):
        taken = {block[q] for q in block if (min(q, r), max(q, r)) in pairs}
        b = 0
        while b in taken:
            b += 1
        block[r] = b
    num_blocks = max(block.values()) + 1 if block else 0

    static = sum(
        regions[r].size_bytes * (not offl[r])
        + on_dev[r] * regions[r].numel * profile.device_state_bytes_per_param
        for r in range(n)
    )
    pool = num_blocks * layout.block_size_bytes
    saved = [0]
    for op in ops:
        saved.append(saved[-1] + op.saved_bytes)

    def grads_at(time: float, after_region: int) -> int:
        """Gradients waiting at ``time``, of regions whose backward came before (index >=
        ``after_region``: backward runs from the last region down)."""
        return sum(
            nb for r, added, copied, nb in grads if r >= after_region and added <= time < copied
        )

    def live_at(time: float) -> int:
        return sum(
            regions[r].size_bytes for r, ivs in life.items() if any(s <= time < e for s, e in ivs)
        )

    # (time, activations, gradients of regions >= this index count) at every instant that
    # matters: operation starts and region ends.
    levels: list[tuple[float, int, int]] = []
    for r, reg in enumerate(regions):
        for j in range(reg.op_start, reg.op_end):
            op = ops[j]
            levels.append((fwd_op_start[j], saved[j] + op.fwd_out_bytes + op.fwd_tmp_bytes, n))
            levels.append(
                (bwd_op_start[j], saved[j + 1] + op.bwd_out_bytes + op.bwd_tmp_bytes, r + 1)
            )
        levels.append((region_end[r], saved[reg.op_start], r))
    peak = max(static + pool + a + grads_at(tm, after) for tm, a, after in levels)
    peak = max(peak, static + pool)
    raw_peak = max(static + a + grads_at(tm, after) + live_at(tm) for tm, a, after in levels)
    return ReferenceResult(
        step_time_s=step,
        peak_bytes=peak,
        raw_peak_bytes=raw_peak,
        coexisting=pairs,
        num_blocks=num_blocks,
        lifetimes=life,
    )
