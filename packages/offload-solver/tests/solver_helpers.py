"""Shared test helpers: random profiles and assignments, and a brute-force reference
simulator written independently of the fast engine (per operation, every memory level
summed from scratch, coexistence by pairwise checks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_solver import (
    BandwidthPoint,
    CostModel,
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    RegionAssignment,
    StatePlacement,
)
from offload_solver.regions import RegionLayout

UNFITTED = CostModel(backward_issue_factor=1.0, stream_up_fraction=1.0, stream_host_charge=1.0)
"""Every factor of the cost model at 1: the simulator prices from the hardware's
measurements alone, as the hand arithmetic of the tests that use it does."""


def flat_hardware(
    h2d_bytes_per_s: float = 1000.0,
    d2h_bytes_per_s: float = 1000.0,
    flop_per_s: float = 1000.0,
    host_adam_params_per_s: float = 1000.0,
    device_adam_params_per_s: float = 1e6,
    host_convert_elems_per_s: float = 0.0,
    device_memory_bytes_per_s: float = 0.0,
    host_copy_contention: float = 1.0,
    host_memory_bytes_per_s: float = 0.0,
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
        device_memory_bytes_per_s=device_memory_bytes_per_s,
        host_copy_contention=host_copy_contention,
        host_memory_bytes_per_s=host_memory_bytes_per_s,
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
        device_memory_bytes_per_s=draw(st.sampled_from([0.0, 64.0, 1024.0])),
        host_memory_bytes_per_s=draw(st.sampled_from([0.0, 1e11])),
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
            # The reference below models DEVICE and HOST state; STREAMED has its own tests.
            state = draw(st.sampled_from([StatePlacement.DEVICE, StatePlacement.HOST]))
        else:
            state = StatePlacement.HOST
        prefetch = draw(st.integers(r + 1, n - 1)) if placement is ParamPlacement.ASYNC else None
        out.append(RegionAssignment(placement, state, prefetch))
    return out


def engine_cases(
    max_examples: int = 200, **more: st.SearchStrategy[Any]
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The random cases the engine is checked on: ``data`` (to draw assignments), a
    ``profile`` (plain or layered), a ``hardware`` profile and ``after_backward`` (the fp16
    order), plus ``more`` strategies, over ``max_examples`` examples."""

    def wrap(test: Callable[..., None]) -> Callable[..., None]:
        cases = given(
            data=st.data(),
            profile=st.one_of(profiles(), layered_profiles()),
            hardware=hardware_profiles(),
            after_backward=st.booleans(),
            **more,
        )
        return settings(
            max_examples=max_examples,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )(cases(test))

    return wrap


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


@dataclass
class _StepTimes:
    """One step of :class:`_ReferenceMachine`, in absolute seconds."""

    start: float
    released: float  # when step() returns: the next step starts then
    makespan_end: float  # when every task of this step (its post-step uploads too) is done
    fwd_op_start: dict[int, float]
    bwd_op_start: dict[int, float]
    region_end: dict[int, float]
    life: dict[int, list[tuple[float, float]]]
    grads: list[tuple[int, float, float, int]]  # (region, added, copied, bytes)


class _ReferenceMachine:
    """The step model of [Note: step model] and [Note: steady state], written plainly: all
    times absolute, lanes and queued uploads persisting from one step to the next.

    Host work per host-state region, on one FIFO worker that takes regions in copy order
    and waits for each copy: widen the copied gradients (unless they cross as fp32 or not
    at all); its gradient-ready hook then runs. With ``host_step_after_backward`` a hook
    that runs after the end of backward steps the region (Adam, then publish unless fp32
    masters are uploaded); the others step after those, in forward order. Without it, a
    hook that runs before the step's last copy has landed steps the region, and step()
    waits for every hook, then queues the others in forward order. A resident region's
    post-step upload goes on H2D at the next issue point of the compute lane after it was
    issued. The next step starts when step() returns; its forward waits, at each region,
    for the updates the region (and the region it prefetches) needs.
    """

    def __init__(
        self,
        profile: ModelProfile,
        hardware: HardwareProfile,
        layout: RegionLayout,
        assignment: list[RegionAssignment],
        host_step_after_backward: bool,
    ) -> None:
        self.profile, self.hw, self.layout = profile, hardware, layout
        self.assignment = assignment
        self.after_backward = host_step_after_backward
        self.place = [a.placement for a in assignment]
        self.on_dev = [a.state is StatePlacement.DEVICE for a in assignment]
        self.offl = [p is not ParamPlacement.RESIDENT for p in self.place]
        self.t = 0.0  # compute lane (and main thread) free
        self.h2d = 0.0
        self.d2h = 0.0
        self.host = 0.0
        self.updated: dict[int, float] = {}  # region -> when its last update ended
        self.upload_end: dict[int, float] = {}  # resident region -> its last upload's end
        self.pending: list[tuple[float, int]] = []  # (issue, region) post-step uploads

    def convert(self, numel: int) -> float:
        rate = self.hw.host_convert_elems_per_s
        return numel / rate if rate > 0 else 0.0

    def up(self, r: int) -> float:
        # Every upload is of a host-state region: its training-dtype bytes, or what the
        # runtime sends per element (4: fp32 masters narrowed on the device).
        per_elem = self.profile.host_upload_bytes_per_param
        reg = self.layout.regions[r]
        return self.hw.h2d_time_s(reg.numel * per_elem if per_elem else reg.size_bytes)

    def drain(self, until: float) -> None:
        while self.pending and self.pending[0][0] <= until:
            issue, q = self.pending.pop(0)
            self.h2d = max(issue, self.h2d) + self.up(q)
            self.upload_end[q] = self.h2d

    def host_update(self, r: int, ready: float) -> None:
        reg = self.layout.regions[r]
        self.host = max(self.host, ready) + reg.numel / self.hw.host_adam_params_per_s
        if self.profile.host_upload_bytes_per_param < 4:
            self.host += self.convert(reg.numel)
        self.updated[r] = self.host
        if not self.offl[r]:
            self.pending.append((self.host, r))

    def step(self) -> _StepTimes:
        profile, hw = self.profile, self.hw
        regions, ops = self.layout.regions, profile.operations
        place, offl, on_dev = self.place, self.offl, self.on_dev
        n = len(regions)
        start = self.t
        never = float("-inf")
        pf_issue: dict[tuple[str, int], float] = {}
        pf_end: dict[tuple[str, int], float] = {}
        life: dict[int, list[tuple[float, float]]] = {r: [] for r in range(n) if offl[r]}
        fwd_op_start: dict[int, float] = {}
        bwd_op_start: dict[int, float] = {}

        def prefetch(tag: str, r: int, issue: float) -> None:
            s = max(issue, self.h2d)
            self.h2d = s + self.up(r)
            pf_issue[tag, r], pf_end[tag, r] = issue, self.h2d

        t = start
        if place[0] is ParamPlacement.ASYNC:
            t = max(t, self.updated.get(0, never))
            self.drain(t)
            prefetch("f", 0, t)
        for r, reg in enumerate(regions):
            nxt_async = r + 1 < n and place[r + 1] is ParamPlacement.ASYNC
            if place[r] is ParamPlacement.SYNC:
                t = max(t, self.updated.get(r, never))
            if nxt_async:
                t = max(t, self.updated.get(r + 1, never))
            self.drain(t)
            reach = t
            if nxt_async:
                prefetch("f", r + 1, reach)
            acquired = reach
            if place[r] is ParamPlacement.SYNC:
                t += self.up(r)
            elif place[r] is ParamPlacement.ASYNC:
                acquired = pf_issue["f", r]
                t = max(t, pf_end["f", r])
            elif r in self.updated:
                t = max(t, self.updated[r])
                self.drain(t)
                t = max(t, self.upload_end[r])
            for j in range(reg.op_start, reg.op_end):
                fwd_op_start[j] = t
                t += hw.op_time_s(ops[j].fwd_flop, ops[j].fwd_traffic_bytes)
            if offl[r]:
                life[r].append((acquired, t))
        fwd_t = t
        saved_lanes = (self.h2d, self.d2h, self.host, list(self.pending), dict(self.upload_end))
        saved_updated = dict(self.updated)

        def backward(deferred: set[int]) -> tuple[float, list[tuple[int, float, float]]]:
            """Backward with the regions in ``deferred`` stepping after their hooks (bf16);
            returns (its end, [(region, copy end, hook time)] in copy order)."""
            nonlocal t
            t = fwd_t
            self.h2d, self.d2h, self.host = saved_lanes[0], saved_lanes[1], saved_lanes[2]
            self.pending, self.upload_end = list(saved_lanes[3]), dict(saved_lanes[4])
            self.updated = dict(saved_updated)
            for lst in life.values():
                del lst[1:]
            grads.clear()
            hooks: list[tuple[int, float, float]] = []
            for r in range(n - 1, -1, -1):
                reg = regions[r]
                reach = t
                self.drain(reach)
                for i in range(n - 1, -1, -1):
                    if place[i] is ParamPlacement.ASYNC and self.assignment[i].prefetch_at == r:
                        prefetch("b", i, reach)
                acquired = reach
                if place[r] is ParamPlacement.SYNC:
                    t += self.up(r)
                elif place[r] is ParamPlacement.ASYNC:
                    acquired = pf_issue["b", r]
                    t = max(t, pf_end["b", r])
                for j in range(reg.op_end - 1, reg.op_start - 1, -1):
                    bwd_op_start[j] = t
                    t += hw.op_time_s(ops[j].bwd_flop, ops[j].bwd_traffic_bytes)
                region_end[r] = t
                if offl[r]:
                    life[r].append((acquired, t))
                if on_dev[r] or reg.numel == 0:
                    continue
                self.d2h = max(t, self.d2h) + hw.d2h_time_s(
                    reg.numel * profile.host_grad_bytes_per_param
                )
                if self.d2h > t and reg.size_bytes:
                    grads.append((r, t, self.d2h, reg.size_bytes))
                if self.after_backward:
                    hooks.append((r, self.d2h, -1.0))
                    continue
                self.host = max(self.d2h, self.host)
                if profile.host_grad_bytes_per_param in (1, 2, 3):
                    self.host += self.convert(reg.numel)
                hooks.append((r, self.d2h, self.host))
                if r not in deferred:
                    self.host_update(r, self.host)
            return t, hooks

        region_end: dict[int, float] = {}
        grads: list[tuple[int, float, float, int]] = []
        bwd_end, hooks = backward(set())
        if not self.after_backward:
            # A hook at or after the last copy defers its region; the runtime decides this
            # as it goes, so the first pass (every region stepping in its hook) is redone
            # with the regions it shows to be deferred.
            last_copy = max((c for _, c, _ in hooks), default=never)
            deferred = {r for r, _, h in hooks if h >= last_copy}
            if deferred:
                bwd_end, hooks = backward(deferred)
            # step() returns once every hook has run.
            released = max(bwd_end, self.host) if hooks else bwd_end
            for r in sorted(deferred):
                self.host_update(r, self.host)
        else:
            waited = []  # hooks that ran by the end of backward: stepped in forward order
            for r, copied, _ in hooks:
                self.host = max(copied, self.host)
                if profile.host_grad_bytes_per_param in (1, 2, 3):
                    self.host += self.convert(regions[r].numel)
                if self.host > bwd_end:
                    self.host_update(r, self.host)
                else:
                    waited.append(r)
            for r in sorted(waited):
                self.host_update(r, bwd_end)
            released = bwd_end
        t = released
        for r in range(n):
            if on_dev[r]:
                t += regions[r].numel / hw.device_adam_params_per_s
        self.t = t
        # The makespan drains this step's uploads on a copy of the H2D lane.
        h2d = self.h2d
        for issue, q in self.pending:
            h2d = max(issue, h2d) + self.up(q)
        return _StepTimes(
            start=start,
            released=t,
            makespan_end=max(t, h2d, self.d2h, self.host),
            fwd_op_start=fwd_op_start,
            bwd_op_start=bwd_op_start,
            region_end=region_end,
            life=life,
            grads=list(grads),
        )


def reference_periods(
    profile: ModelProfile,
    hardware: HardwareProfile,
    layout: RegionLayout,
    assignment: list[RegionAssignment],
    *,
    host_step_after_backward: bool = False,
    steps: int,
) -> list[float]:
    """Seconds between the starts of ``steps`` consecutive steps (the first is cold)."""
    machine = _ReferenceMachine(profile, hardware, layout, assignment, host_step_after_backward)
    return [st.released - st.start for st in (machine.step() for _ in range(steps))]


def reference_simulate(
    profile: ModelProfile,
    hardware: HardwareProfile,
    layout: RegionLayout,
    assignment: list[RegionAssignment],
    *,
    host_step_after_backward: bool = False,
) -> ReferenceResult:
    """One cold step of :class:`_ReferenceMachine`, memory by brute force."""
    machine = _ReferenceMachine(profile, hardware, layout, assignment, host_step_after_backward)
    st = machine.step()
    regions = layout.regions
    ops = profile.operations
    n = len(regions)
    offl, on_dev = machine.offl, machine.on_dev
    life, grads = st.life, st.grads
    fwd_op_start, bwd_op_start, region_end = st.fwd_op_start, st.bwd_op_start, st.region_end

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
        step_time_s=st.makespan_end - st.start,
        peak_bytes=peak,
        raw_peak_bytes=raw_peak,
        coexisting=pairs,
        num_blocks=num_blocks,
        lifetimes=life,
    )


def chain(sizes: list[int], fwd_flop: int, bwd_flop: int) -> ModelProfile:
    """One operation per parameter; each saves 1000 bytes for backward, nothing else."""
    params = tuple(Parameter(f"w{i}", s // 2, s) for i, s in enumerate(sizes))
    ops = tuple(
        Operation(f"op{i}", (f"w{i}",), saved_bytes=1000, fwd_flop=fwd_flop, bwd_flop=bwd_flop)
        for i in range(len(sizes))
    )
    # No gradient bytes cross to the host, so gradients never wait on the device and the
    # dynamic peak is the activations alone: the last op's backward sees all 1000 x n saved.
    return ModelProfile("chain", params, ops, host_grad_bytes_per_param=0)


def viewed_chain(
    regions: int,
    views: int,
    *,
    size_bytes: int,
    saved_bytes: int,
    flop: int,
    bwd_flop: int,
    name: str = "viewed",
) -> ModelProfile:
    """Per region one operation of ``flop`` FLOP forward and ``bwd_flop`` backward on its
    parameter (``size_bytes`` bytes, 2 a element) that saves ``saved_bytes`` for
    backward, then ``views`` operations that compute nothing (views); no gradient bytes
    cross to the host."""
    params = tuple(Parameter(f"w{i}", size_bytes // 2, size_bytes) for i in range(regions))
    ops: list[Operation] = []
    for i in range(regions):
        kernel = Operation(
            f"mm{i}", (f"w{i}",), saved_bytes=saved_bytes, fwd_flop=flop, bwd_flop=bwd_flop
        )
        ops.append(kernel)
        ops.extend(Operation(f"view{i}_{k}") for k in range(views))
    return ModelProfile(name, params, tuple(ops), host_grad_bytes_per_param=0)


def solve_near(
    profile: ModelProfile, hardware: HardwareProfile, where: float, **kwargs: Any
) -> tuple[int, Plan]:
    """A budget of ``where`` times the all-resident plan's peak over the planning share
    (raised to the least budget that fits where that is too small) and ``solve``'s plan
    for it with ``kwargs``."""
    from offload_solver import SimulationContext, get_simulator, solve
    from offload_solver.solve import BUDGET_SAFETY_FACTOR, InfeasibleBudgetError

    ctx = SimulationContext.build(
        profile,
        hardware,
        host_step_after_backward=kwargs.get("host_step_after_backward", False),
        streamed=kwargs.get("streamed"),
    )
    top = get_simulator("async").run(ctx, [RegionAssignment()] * ctx.num_regions).peak_bytes
    budget = max(1, int(top * where / BUDGET_SAFETY_FACTOR))
    try:
        return budget, solve(profile, hardware, budget, **kwargs)
    except InfeasibleBudgetError as exc:
        return exc.least_budget_bytes, solve(profile, hardware, exc.least_budget_bytes, **kwargs)
