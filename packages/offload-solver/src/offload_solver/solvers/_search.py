"""Greedy search state shared by the solvers: the current assignment and cheap estimates.

[Note: incremental candidate evaluation]
Simulating every candidate would cost a whole step per candidate per greedy round, which
is quadratic in the number of regions. Instead each round simulates the current
assignment once, runs a critical-path analysis over its tasks (``_engine.slack``: how
late each task could start without ending the step later), and estimates every candidate
from a handful of per-region numbers:

- Memory. Offloaded regions live in the pool, so offloading region r lowers the static
  bytes by its size, as long as some existing pool block is free during r's lifetimes
  (read off the current timeline and the lifetimes of nearby offloaded regions); otherwise
  it needs another block. Candidates that fit the existing blocks are preferred (the
  first block is free: any offload needs one); among them, or when none fits, the one
  with most bytes saved per second of extra time wins.
- Time. A candidate inserts delays: a sync upload delays region r's forward and
  backward computes by the upload time; a prefetch delays r's compute by however much it
  ends after the compute would otherwise start, and delays the next H2D transfer by
  however much it overlaps it. A delay ``d`` at a task with slack ``s`` lengthens the step
  by ``max(0, d - s)``; a forward delay is assumed to reach the backward in full, so the
  estimate errs long.

The chosen candidate is then simulated in full (``num_simulations`` counts these runs),
and the next round starts from that simulation, so an estimate's error never carries
into the plan, only into which candidate is tried.

All of this reads the cold step (one step on an idle machine), which is cheap to
simulate and to analyse. Where a change is accepted for making the step shorter (moving
optimizer state to the device), the steady-state periods are compared instead ([Note:
steady state] in ``_steady``: host work the next forward hides gains nothing); their
gated steps count as simulations too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offload_solver.plan import ParamPlacement, StatePlacement
from offload_solver.simulators._engine import (
    ASYNC,
    RESIDENT,
    EngineRun,
    RegionAssignment,
    SimulationContext,
    SteadyState,
    first_fit,
    overlaps,
    slack,
    steady_state,
)
from offload_solver.simulators.base import Simulator

_EPS_S = 1e-12
"""Times within this many seconds count as equal (float noise in summed durations)."""


@dataclass(frozen=True)
class Move:
    """One candidate change: give ``region`` a new placement (and backward prefetch host)."""

    region: int
    placement: ParamPlacement
    prefetch_at: int | None = None


@dataclass
class SolveStats:
    """Counters a solve reports in its plan."""

    num_simulations: int = 0


@dataclass(frozen=True)
class Candidate:
    """An assignment with its simulated cold step and repeating (steady) step: what the
    phases after the greedy search (streaming, local search) take and return."""

    assignment: list[RegionAssignment]
    cold: EngineRun
    steady: SteadyState

    @property
    def period_s(self) -> float:
        """The repeating step's time (seconds)."""
        return self.steady.period_s

    @property
    def peak_bytes(self) -> int:
        """The larger of the cold step's peak and the repeating step's streaming peak."""
        return max(self.cold.peak_bytes, self.steady.last.stream_peak_bytes)


def evaluate(
    ctx: SimulationContext,
    simulator: Simulator,
    stats: SolveStats,
    assignment: Sequence[RegionAssignment],
    cap_bytes: float | None = None,
) -> Candidate | None:
    """Simulate ``assignment``'s cold step and then its repeating step, counting each
    simulation in ``stats``. None, without the repeating step, when the cold step's peak
    is over ``cap_bytes``."""
    run = simulator.run(ctx, assignment)
    if cap_bytes is not None and run.peak_bytes > cap_bytes:
        stats.num_simulations += 1
        return None
    st = steady_state(ctx, assignment, run)
    stats.num_simulations += len(st.periods_s)
    return Candidate(list(assignment), run, st)


class GreedySearch:
    """The current assignment of a greedy solver and its latest full simulation."""

    def __init__(
        self,
        ctx: SimulationContext,
        simulator: Simulator,
        cap_bytes: float,
        stats: SolveStats,
        start: Sequence[RegionAssignment],
    ) -> None:
        self.ctx = ctx
        self.simulator = simulator
        self.cap_bytes = cap_bytes
        self.stats = stats
        self.assignment = list(start)
        self.current = self.simulate(self.assignment)
        self._steady: SteadyState | None = None
        self._slack: list[float] | None = None
        self._next_fwd_prefetch: list[int] | None = None
        self._window: int | None = None
        self.keep_resident: set[int] = set()
        """Regions the strategies must not offload (the target of ``make_room_for_state``)."""

    # ---- state ---------------------------------------------------------------------

    def simulate(self, assignment: Sequence[RegionAssignment]) -> EngineRun:
        """A full simulation, counted."""
        self.stats.num_simulations += 1
        return self.simulator.run(self.ctx, assignment)

    @property
    def peak_bytes(self) -> int:
        return self.current.peak_bytes

    @property
    def fits(self) -> bool:
        return self.current.peak_bytes <= self.cap_bytes

    def reset(
        self,
        assignment: Sequence[RegionAssignment],
        result: EngineRun,
        steady: SteadyState | None = None,
    ) -> None:
        """Make ``assignment`` (simulated as ``result``, with ``steady`` its steady state
        when known) the current state."""
        self.assignment = list(assignment)
        self.current = result
        self._steady = steady
        self._slack = None
        self._next_fwd_prefetch = None
        self._window = None

    def steady(self) -> SteadyState:
        """The steady state of the current assignment (computed once per assignment; its
        gated steps count as simulations)."""
        if self._steady is None:
            self._steady = steady_state(self.ctx, self.assignment, self.current)
            self.stats.num_simulations += len(self._steady.periods_s) - 1
        return self._steady

    def period_s(self) -> float:
        """Seconds per step of the current assignment once steps repeat."""
        return self.steady().period_s

    def try_assignment(self, assignment: Sequence[RegionAssignment]) -> EngineRun:
        """Simulate ``assignment`` and make it current (callers keep the previous state to
        go back with ``reset``)."""
        result = self.simulate(assignment)
        self.reset(assignment, result)
        return result

    def slack(self) -> list[float]:
        """Per task slack of the current run (computed once per run)."""
        if self._slack is None:
            self._slack = slack(self.current)
        return self._slack

    def offloadable(self) -> list[int]:
        """Resident, non-pinned regions that own parameter bytes and keep their optimizer
        state on the host (minus those ``keep_resident`` holds back)."""
        ctx = self.ctx
        run = self.current
        return [
            r
            for r in range(ctx.num_regions)
            if run.codes[r] == RESIDENT
            and not run.device_state[r]
            and not ctx.pinned[r]
            and ctx.size[r] > 0
            and r not in self.keep_resident
        ]

    def apply(self, move: Move) -> EngineRun:
        """Offload (or re-place) ``move.region`` as the move says and simulate."""
        asg = list(self.assignment)
        asg[move.region] = RegionAssignment(move.placement, StatePlacement.HOST, move.prefetch_at)
        return self.try_assignment(asg)

    # ---- estimates (see the note) -------------------------------------------------

    def window(self) -> int:
        """Longest backward prefetch distance in the current assignment (at least 1)."""
        if self._window is None:
            run = self.current
            self._window = max(
                [1] + [run.prefetch_at[j] - j for j, c in enumerate(run.codes) if c == ASYNC]
            )
        return self._window

    def next_fwd_prefetch(self) -> list[int]:
        """Per region r, the forward prefetch task of the first async region after r."""
        if self._next_fwd_prefetch is None:
            run = self.current
            out = [-1] * self.ctx.num_regions
            nxt = -1
            for r in range(self.ctx.num_regions - 1, -1, -1):
                out[r] = nxt
                if run.codes[r] == ASYNC:
                    nxt = run.pf_f_task[r]
            self._next_fwd_prefetch = out
        return self._next_fwd_prefetch

    def _estimate(self, move: Move) -> tuple[float, list[tuple[float, float]]]:
        """(extra step seconds, device lifetimes) of ``move`` on the current timeline."""
        run = self.current
        sl = self.slack()
        r = move.region
        u = self.ctx.upload_s[r]
        f_slack = sl[run.f_task[r]]
        b_slack = sl[run.b_task[r]]
        code = run.codes[r]
        if move.placement is ParamPlacement.SYNC:
            # Resident -> sync: an upload before each compute. Async -> sync (repair): the
            # upload replaces the wait for the prefetch.
            d_f = max(0.0, run.reach_f[r] + u - run.cs_f[r]) if code == ASYNC else u
            d_b = max(0.0, run.reach_b[r] + u - run.cs_b[r]) if code == ASYNC else u
            extra = max(0.0, d_f - f_slack, d_f + d_b - b_slack)
            life = [(run.reach_f[r], run.ce_f[r]), (run.reach_b[r], run.ce_b[r])]
            return extra, life
        assert move.prefetch_at is not None
        p = move.prefetch_at
        start = run.start
        # Forward prefetch, issued when the compute lane reaches region r-1.
        s_f = 0.0 if r == 0 else max(run.reach_f[r - 1], run.h2d_free_at_reach_f[r - 1])
        e_f = s_f + u
        d_f = max(0.0, e_f - run.cs_f[r])
        extra = max(0.0, d_f - f_slack)
        nxt = self.next_fwd_prefetch()[r]
        if nxt >= 0:
            extra = max(extra, e_f - start[nxt] - sl[nxt])
        # Backward prefetch, issued when the compute lane reaches region p's backward.
        s_b = max(run.reach_b[p], run.h2d_free_after_b[p])
        e_b = s_b + u
        d_b = max(0.0, e_b - run.cs_b[r])
        extra = max(extra, d_f + d_b - b_slack)
        pos = run.h2d_pos_after_b[p]
        if pos < len(run.h2d_order):
            nb = run.h2d_order[pos]
            extra = max(extra, d_f + e_b - start[nb] - sl[nb])
        issue_f = 0.0 if r == 0 else run.reach_f[r - 1]
        life = [(issue_f, run.ce_f[r]), (run.reach_b[p], run.ce_b[r])]
        return extra, life

    def needs_new_block(self, r: int, life: Sequence[tuple[float, float]], reach: int) -> bool:
        """Whether every existing pool block is held by a region coexisting with ``life``."""
        run = self.current
        have = max(run.num_blocks, 1)
        used: set[int] = set()
        lo = max(0, r - self.window() - 2)
        hi = min(self.ctx.num_regions, max(r, reach) + 3)
        for j in range(lo, hi):
            if j != r and run.codes[j] and overlaps(run.lifetimes[j], life):
                used.add(run.blocks[j])
                if len(used) >= have:
                    return True
        return False

    def choose(self, moves: Sequence[Move]) -> Move:
        """The move to make next: fits the pool's blocks, then most bytes per second."""
        ctx = self.ctx
        scored = []
        for i, m in enumerate(moves):
            extra, life = self._estimate(m)
            size = ctx.size[m.region]
            ratio = size / extra if extra > _EPS_S else math.inf
            p = m.prefetch_at if m.prefetch_at is not None else m.region
            scored.append((-ratio, -size, m.region, p, i, life))
        scored.sort(key=lambda x: x[:5])
        for _, _, r, p, i, life in scored:
            if not self.needs_new_block(r, life, p):
                return moves[i]
        return moves[scored[0][4]]

    # ---- repair ---------------------------------------------------------------------

    def repair(self) -> bool:
        """Turn the async prefetch whose sync upload frees most pool bytes per second back
        into a sync upload; ``False`` when none lowers the simulated peak."""
        run = self.current
        ctx = self.ctx
        offloaded = [r for r, c in enumerate(run.codes) if c]
        window = self.window()
        tried: list[tuple[float, int, int]] = []
        for r in offloaded:
            if run.codes[r] != ASYNC:
                continue
            extra, life = self._estimate(Move(r, ParamPlacement.SYNC))
            adjacent = dict(run.adjacent)
            for j in run.adjacent[r]:
                adjacent[j] = adjacent[j] - {r}
            adjacent[r] = set()
            lo, hi = max(0, r - window - 2), min(ctx.num_regions, r + window + 3)
            for j in range(lo, hi):
                if j != r and run.codes[j] and overlaps(run.lifetimes[j], life):
                    adjacent[j] = adjacent[j] | {r}
                    adjacent[r].add(j)
            blocks = first_fit(offloaded, adjacent)
            freed = run.num_blocks - (max(blocks.values()) + 1)
            if freed > 0:
                saving = freed * ctx.block_size_bytes
                ratio = saving / extra if extra > _EPS_S else math.inf
                tried.append((-ratio, -saving, r))
        tried.sort()
        before_asg, before_run = list(self.assignment), run
        for _, _, r in tried[:3]:
            result = self.apply(Move(r, ParamPlacement.SYNC))
            if result.peak_bytes < before_run.peak_bytes:
                return True
            self.reset(before_asg, before_run)
        return False

    # ---- optimizer state placement ----------------------------------------------------

    def _state_candidate(self, excluded: set[int], *, need_room: bool) -> int | None:
        """The resident host-state region whose host step is critical and whose host work
        (gradient widening, Adam, publish) is longest.

        The host steps of the earliest forward regions run last, so they are usually the
        critical tail of the step; a region whose host step has slack would save nothing.
        With ``need_room`` only regions whose state fits under the cap now are considered.
        """
        ctx = self.ctx
        run = self.current
        sl = self.slack()
        best: tuple[float, int] | None = None
        for r in range(ctx.num_regions):
            if (
                run.codes[r] != RESIDENT
                or run.device_state[r]
                or ctx.trainable[r] == 0
                or r in excluded
                or (need_room and run.peak_bytes + ctx.state_bytes[r] > self.cap_bytes)
            ):
                continue
            ht = run.host_task[r]
            if ht < 0 or sl[ht] > _EPS_S:
                continue
            gain = ctx.host_work_s[r]  # all of it leaves the host lane, not only Adam
            if best is None or gain > best[0]:
                best = (gain, r)
        return None if best is None else best[1]

    def _to_device_state(self, r: int) -> EngineRun:
        asg = list(self.assignment)
        asg[r] = RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.DEVICE)
        return self.try_assignment(asg)

    def place_optimizer_state(self) -> None:
        """Move resident regions' optimizer state to the device while the cap allows, the
        region whose host step is on the critical path and longest first.

        Candidates come from the cold step's critical path; each move is simulated and
        kept only if the peak still fits and the steady-state step got shorter (host work
        that the next forward hides gains nothing); a region whose move is not kept is not
        tried again.
        """
        excluded: set[int] = set()
        while (r := self._state_candidate(excluded, need_room=True)) is not None:
            before_asg, before_run, before = list(self.assignment), self.current, self.steady()
            result = self._to_device_state(r)
            if result.peak_bytes > self.cap_bytes or self.period_s() >= before.period_s - _EPS_S:
                self.reset(before_asg, before_run, before)
                excluded.add(r)

    def make_room_for_state(
        self, offload: Callable[[GreedySearch], bool], max_failures: int = 2
    ) -> None:
        """Offload more parameters where that makes room for a critical region's optimizer
        state on the device and the step gets shorter.

        Device optimizer state costs ``device_state_bytes_per_param`` per element (16 for
        fp16 training) against 2 for the parameters, so room for one region's state takes
        several offloaded regions; when the host optimizer is the step's tail, offloading
        them costs less than it saves. For the region :meth:`place_optimizer_state` would
        move next, ``offload`` (the strategy) offloads against the cap minus its state,
        then the state moves; the whole change is kept only if it fits and the simulated
        step is shorter (in steady state). Stops after ``max_failures`` regions in a row
        gain nothing.
        """
        excluded: set[int] = set()
        failures = 0
        while failures < max_failures:
            target = self._state_candidate(excluded, need_room=False)
            if target is None:
                return
            before_asg, before_run, before = list(self.assignment), self.current, self.steady()
            cap = self.cap_bytes
            self.cap_bytes = cap - self.ctx.state_bytes[target]
            self.keep_resident.add(target)
            try:
                made_room = offload(self)
            finally:
                self.cap_bytes = cap
                self.keep_resident.discard(target)
            if made_room:
                result = self._to_device_state(target)
                if result.peak_bytes <= cap and self.period_s() < before.period_s - _EPS_S:
                    failures = 0
                    self.place_optimizer_state()
                    continue
            self.reset(before_asg, before_run, before)
            excluded.add(target)
            failures += 1
