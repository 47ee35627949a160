"""The overlap of host steps with backward: its modes, as a state machine, and the hooks.

[Note: overlapping the host step with backward]
The step of a host-state region can start as soon as that region's fp32 gradients are
complete on the host (the runtime's grad-ready hook, on the host worker), while the GPU
still runs backward for the regions before it. Whether that early step equals the step
after backward depends on whether the step needs a *global* answer first:
- fp16 training needs to know whether any region overflowed (then no region steps);
- global-norm clipping needs the norm over all regions (it scales every gradient).
Both answers exist only once the last region's gradients are in. Options:
1. step speculatively and undo when the answer says so. Adam is not invertible in floating
   point, so an exact undo needs master and moments as they were before the step. Taken as
   a copy pass before the step, that is 24 bytes per parameter more memory traffic (12
   written, 12 read back) on top of the step's 28: nearly double, every step, to save the
   rare overflowing step; rejected in that form. Taken chunk by chunk in cache right
   before each chunk's fused Adam (see [Note: speculative steps] in speculation.py: a
   master backup, and the new moments written to a spare pair so that the old ones stay),
   main memory sees about 32 bytes per parameter instead of 28 (plus the write-allocate
   reads of the three fresh destinations on CPUs that do not stream them), and the commit
   is a swap of references. Used for fp16 overflow only, where the plan says so
   (``PlanOptions.speculative``: :attr:`OverlapMode.SPECULATIVE_UNDO`); it costs 12 bytes
   per host-state parameter of host memory (8 with bf16 moments). Clipping is not
   speculated: its factor changes the gradients of every step, so every step would be
   undone. With torch's kernels the speculative step costs well over the plain one; the
   single-pass kernel writes the undo data in the step's own pass ([Note: single-pass host
   Adam] in offload_runtime/host_kernels/single_pass.py), and the planner speculates with
   it (measured: BENCHMARKS.md, Decisions, "Speculative fp16 host steps"). See [Note:
   speculative steps] in speculation.py.
2. speculate only where no answer is needed, and otherwise overlap only the
   answer-independent work (the default):
   - bf16 / fp32 training without clipping (:attr:`OverlapMode.SPECULATIVE`): each
     host-state region steps in its hook. The gradients it reads are final, so the result
     is the step after backward, bit for bit.
   - fp16 training, or clipping, without accumulation, and fp16 training without clipping
     with accumulation (:attr:`OverlapMode.DEVICE_ANSWER`, the default there): each
     host-state region's contribution to the answer (the L1
     norm of its training-dtype gradients, in fp32, finite exactly when they all are: the
     overflow check; or their ``norm_type`` norms for clipping) is taken on the device,
     on the compute stream, right before its gradients are copied to the host (the
     runtime's device grad hook). ``step()`` therefore has the answer as soon as
     backward's kernels finish, not after the last gradient copy lands and the host has
     read every gradient once more. Then each host-state region whose gradients are
     still in flight steps in its own grad-ready hook as they land (in landing order),
     with the scale and clip factor ``step()`` fixed; those that landed earlier are
     queued in forward order behind them. Where the gradient copies lag backward, the
     host starts stepping when backward ends instead of when the last copy lands.
     ``overlap=False`` combines the same device partials, so both give the same answer
     bit for bit (the norm differs from one taken over the flat fp32 accumulators only
     in rounding: widening is exact, the grouping of the sum is not).
     With accumulation the overflow check sums each region's L1 partials over the
     micro-batches: fp16 gradients are finite and at most 65504 per element, so their
     fp32 sum in the host accumulator is finite exactly when every micro-batch's was, and
     the summed partials say so (bit-identical skip decisions to checking the
     accumulators). Only the last backward's landings count for stepping in hooks; regions
     whose gradients came from earlier micro-batches alone are queued.
   - clipping with accumulation (:attr:`OverlapMode.PARTIALS`): the norm is that of the sum
     of the micro-batches, which only the host accumulators hold (it is not a function of
     the micro-batches' norms), so each host-state region's hook computes its partial
     there while the last backward runs; after backward the partials are combined, and
     the regions step then.
   Device-state regions always step after backward, all in one batch: their step is GPU
   work that would queue behind backward on the same stream anyway.
SPECULATIVE_UNDO (fp16 without clipping, a speculative plan): each host-state
region's hook steps it speculatively and returns its overflow partial, read in the same
pass (``HybridAdam.speculate_region``: the sum of the gradients, not their L1 norm, since
only finiteness matters here and a sum reads faster); the step divides by the loss scale
of the backward, which is the one ``step()`` would use. The device partials of
DEVICE_ANSWER are taken too, and ``step()`` combines them (the device's where taken,
else the hooks') as PARTIALS does: a hook that runs once backward is over only notes its
region, with no host pass over the gradients. No overflow: the host task ``step()``
queues issues the streamed regions first, then commits the speculative steps (a swap of
moment references) and publishes them in forward order together with the steps of the
regions that did not speculate (the tail, below; nothing else changes), and the scale
grows as usual. With ``PlanOptions.speculation_thread`` the hooks hand their
speculative steps to a thread of their own (``HybridAdam.submit_speculation``), so the
host worker keeps taking landed gradients meanwhile: ``step()`` then waits for the
gradients, not for the speculative step in flight when backward ends, and its task waits
for that step (``HybridAdam.wait_speculation``) only after issuing the streamed regions
(on by default; measured: BENCHMARKS.md, Decisions, "Threads that issue, publish and
speculate"). Overflow: every
speculative step is undone, once it has ended (master from its backup, step counts
restored; moments never written), the step is skipped and the scale backs off:
:attr:`StepReport.undone_regions` and :attr:`AMPOptimizer.undone_steps` count it. The
result is the non-speculative result, bit for bit. Nothing is published before the commit, but
the masters change in place under backward: until ``step()`` decides, an eval forward
or ``module.state_dict()`` would see stepped masters (those regions that upload straight
from the master, with ``convert_on_device``) next to unstepped training-dtype copies
(the others). Run such things after ``step()``, as the training loop does;
``amp.state_dict()`` refuses to run mid-window. ``zero_grad()`` (or
``load_state_dict``) before ``step()`` undoes the speculative steps. bf16 host moments
speculate the same way (widened and narrowed per chunk, no extra copy).
Speculation happens only in the backward of the last micro-batch of an accumulation
window (``accumulation_steps`` says which one), so accumulated gradients are never stepped
early. The hyperparameters an early step used are checked again in ``step()``: changing
a learning rate between ``backward`` and ``step`` raises instead of silently differing.

After backward, the host steps also overlap the *next forward* (with ``overlap``):
- ``step()`` waits for the window's host gradient work (it holds the partials, and says
  which regions stepped early; DEVICE_ANSWER does not wait, see above), then queues the
  remaining host-state regions' steps on the host worker in forward order, steps the
  device-state regions on this thread, and returns without waiting. The runtime's
  ``begin_forward`` / ``upload`` / ``prefetch`` of region ``r`` waits (on the host, only
  while it still runs) for ``r``'s step and publish (``OffloadController.expect_updates``),
  so region 0 computes while later regions still step. In fp16 that is where the host
  step hides: it cannot start before backward ends.
- A queued step is fixed when queued: the hyperparameters (a scheduler may change ``lr``
  right after ``step()``), the loss scale and clip factor, and which segments have
  gradients. It reads the flat gradient accumulators, never ``.grad``.
- In DEVICE_ANSWER, the hooks still to run after ``step()`` step their regions with
  what ``step()`` fixed (hyperparameters, scale), and announce them to the runtime the
  same way; ``zero_grad()`` waits for those hooks (they are gradient work), not for the
  queued steps behind them.
- ``zero_grad()`` does not wait for queued steps: ``set_to_none`` only drops the
  ``.grad`` references, and the runtime overwrites each accumulator when the region's next
  gradients arrive, on the host worker, which runs them after the queued steps (one FIFO
  worker); ``set_to_none=False`` zeroes host accumulators on the worker, after the steps.
- Whatever reads master weights or optimizer state waits for the queued steps first:
  ``module.named_parameters()``, ``state_dict()`` / ``load_state_dict()`` (module and
  optimizers), ``module.close()``, ``last_step`` (it is completed with the steps'
  timings), ``synchronize()`` (call it before reading ``amp.state`` directly).
- An error raised by a queued step surfaces at the next of those waits, or at the forward
  of that region.
- SPECULATIVE tail: hooks step their region (in backward order) only while the device
  still runs backward or its gradient copies, which is when the step hides under them. A
  hook that runs once the last gradient copy of the backward has landed (an event
  recorded on the d2h stream after backward, polled without blocking; so it completes
  with that copy, even while backward still computes device-state regions) leaves its
  region to ``step()``, which queues such
  regions in forward order: region 0, whose gradients arrive last, then steps first and
  the next forward can start while the others step. SPECULATIVE_UNDO keeps the same
  rule: such a hook steps nothing (and computes no partial: the device took it), and
  the region steps after the answer, as in PARTIALS.
Without overlap (``PlanOptions.overlap`` False: the reference's behaviour) every host
region steps in ``step()``, after backward, and ``step()`` waits for them.

[Note: the overlap state machine]
The modes above are the states of one machine, :class:`OverlapMode`, whose state is the
mode of the accumulation window on the main thread (:attr:`Window.mode`). It changes only
through :func:`transition`, which asserts the change is in :data:`TRANSITIONS`:
- NONE -> NONE: a backward of a micro-batch before the window's last (accumulating), or
  the last one without ``overlap``; also ``step()`` or ``zero_grad()`` of such a window;
- NONE -> SPECULATIVE | PARTIALS | SPECULATIVE_UNDO | DEVICE_ANSWER: the window's last
  backward, as :func:`choose_mode` picks it (bf16/fp32 without clipping: SPECULATIVE;
  fp16 with a speculative plan and no clipping: SPECULATIVE_UNDO; an answer the device
  can give: DEVICE_ANSWER; clipping over accumulated micro-batches: PARTIALS);
- any of those four -> NONE: ``step()`` or ``zero_grad()`` closes the window.
So a window enters at most one overlapping mode, once, and leaves it only by closing.
The host worker follows the main thread's modes, behind it: each backward queues its mode
there (:meth:`Overlap.enter`), behind the hooks of the backward before, so every
grad-ready hook sees the mode of the backward that produced its gradients
(:attr:`Overlap.host_mode`). It keeps a closed window's mode until the next backward's
arrives, since a DEVICE_ANSWER window's hooks may still run after ``step()`` has closed
the window on the main thread; every other window's hooks have run by then (``step()``
and ``zero_grad()`` wait for them). What a host-state region's hook does in each state is
one handler of :class:`Overlap`, chosen by that state (:meth:`Overlap.on_grad_ready`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from offload_optim.clipping import partials_of
from offload_runtime.host_kernels import AdamHyper

if TYPE_CHECKING:
    from offload_optim.hybrid_adam import HybridAdam
    from offload_optim.reports import RegionStepTiming
    from offload_runtime.controller import OffloadController
    from offload_runtime.streams import Event


class OverlapMode(str, Enum):
    """What the grad-ready hook of a host-state region does (see [Note: overlapping the
    host step with backward]); the states of [Note: the overlap state machine]."""

    NONE = "none"
    """Nothing: accumulating micro-batches, or overlap disabled."""
    SPECULATIVE = "speculative"
    """Step the region (no global answer needed)."""
    PARTIALS = "partials"
    """Compute the region's norm partial on the host (clipping over accumulated windows);
    the region steps after backward."""
    SPECULATIVE_UNDO = "speculative_undo"
    """fp16: step the region speculatively and compute its overflow partial; the step is
    committed, or undone exactly on overflow, after backward (``PlanOptions.speculative``)."""
    DEVICE_ANSWER = "device_answer"
    """fp16 or clipping with one micro-batch per step, or fp16 without clipping over any
    number (the default there): the region's partials of the answer are taken on the
    device before its gradients leave it (summed over micro-batches), so
    :meth:`AMPOptimizer.step` knows the answer when backward ends; the region steps in its
    hook once the answer is known (as its gradients land), else in
    :meth:`AMPOptimizer.step`'s forward-order queue."""


_OVERLAPPING = frozenset(
    {
        OverlapMode.SPECULATIVE,
        OverlapMode.PARTIALS,
        OverlapMode.SPECULATIVE_UNDO,
        OverlapMode.DEVICE_ANSWER,
    }
)

TRANSITIONS: dict[OverlapMode, frozenset[OverlapMode]] = {
    OverlapMode.NONE: frozenset({OverlapMode.NONE}) | _OVERLAPPING,
    **{mode: frozenset({OverlapMode.NONE}) for mode in _OVERLAPPING},
}
"""The changes of a window's mode that may happen (see [Note: the overlap state
machine]): from NONE to any mode (a backward), from any mode to NONE (closing)."""

EARLY_STEPS = frozenset({OverlapMode.SPECULATIVE, OverlapMode.SPECULATIVE_UNDO})
"""Modes whose hooks step host-state regions before ``step()``, with the hyperparameters
of the backward (and so refuse an ``lr`` changed before ``step()``)."""


def transition(current: OverlapMode, new: OverlapMode) -> OverlapMode:
    """Return ``new``, the state after ``current``; asserts the change is in
    :data:`TRANSITIONS` (an internal invariant: ``AMPOptimizer`` refuses the calls that
    would break it, such as a backward after the window's last)."""
    assert new in TRANSITIONS[current], f"overlap mode {current.name} -> {new.name}"
    return new


def choose_mode(
    *,
    last: bool,
    overlap: bool,
    needs_answer: bool,
    speculate: bool,
    answer_on_device: bool,
    early_steps: bool = True,
) -> OverlapMode:
    """The mode of a backward: NONE unless it is the window's ``last`` micro-batch with
    ``overlap``; then SPECULATIVE_UNDO when asked to ``speculate`` (fp16, no clipping),
    else DEVICE_ANSWER when the ``answer_on_device`` can be taken, else PARTIALS when the
    step ``needs_answer``, else SPECULATIVE. Without ``early_steps`` no region steps
    before ``step()`` (no SPECULATIVE_UNDO, SPECULATIVE becomes NONE: ``AMPOptimizer``'s
    [Note: clipping on demand])."""
    if not (last and overlap):
        return OverlapMode.NONE
    if speculate and early_steps:
        return OverlapMode.SPECULATIVE_UNDO
    if answer_on_device:
        return OverlapMode.DEVICE_ANSWER
    if needs_answer:
        return OverlapMode.PARTIALS
    return OverlapMode.SPECULATIVE if early_steps else OverlapMode.NONE


@dataclass
class Answer:
    """What :meth:`AMPOptimizer.step` decided for a DEVICE_ANSWER window, for the hooks of
    host-state regions whose gradients land afterwards (read under ``AnswerWindow.lock``)."""

    skip: bool
    grad_scale: float | None
    hypers: dict[int, AdamHyper]
    timings: list[RegionStepTiming]
    futures: dict[int, Future[None]]
    """The regions the hooks step, each completed once stepped and published."""


class AnswerWindow:
    """A DEVICE_ANSWER window as its host-worker hooks see it. It outlives the window on
    the main thread: hooks of the last window may still run after ``step()`` closed it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answer: Answer | None = None
        self.landed: set[int] = set()
        """Host-state regions whose gradients of this (the window's last) backward landed
        before the answer; earlier micro-batches' landings do not count."""
        self.mode_set = threading.Event()
        """Set on the host worker when it enters this window's mode, behind every hook of
        the window's earlier micro-batches."""


@dataclass(eq=False)
class Window:
    """One accumulation window on the main thread: from the first backward after a step
    to the next ``step()`` or ``zero_grad()``, which replace it with a new one (hooks and
    speculative steps that outlive it keep the containers they took)."""

    micro: int = 0
    """Backward passes so far."""
    mode: OverlapMode = OverlapMode.NONE
    """The state (see [Note: the overlap state machine]); changed by :meth:`enter`."""
    notified: set[int] = field(default_factory=set)
    """Regions whose gradients arrived in the window."""
    stepped: set[int] = field(default_factory=set)
    """Regions stepped early (SPECULATIVE, SPECULATIVE_UNDO)."""
    partials: dict[int, torch.Tensor] = field(default_factory=dict)
    """Region -> its hook's partial of the answer (PARTIALS, SPECULATIVE_UNDO)."""
    hypers: dict[int, AdamHyper] = field(default_factory=dict)
    """What early steps use (SPECULATIVE, SPECULATIVE_UNDO)."""
    spec_scale: float | None = None
    """What speculative steps divide by (SPECULATIVE_UNDO)."""
    device_parts: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Each host-state region's partials of the answer, taken on the device (backward
    thread) in a window whose answer they give (summed over micro-batches)."""
    device_current: set[int] = field(default_factory=set)
    """Regions the last backward took device partials for."""
    device_answer: bool = False
    """Whether this window takes device partials (set by each backward)."""
    as_norm: bool = False
    """Whether partials are norms (clipping) rather than L1 sums (overflow check)."""
    norm_type: float = 2.0
    """The norm of the partials (clipping's ``norm_type``)."""
    answer_window: AnswerWindow | None = None
    """DEVICE_ANSWER: the window its host-worker hooks answer to."""
    timings: list[RegionStepTiming] = field(default_factory=list)
    """The window's region steps."""
    done_box: list[Event | None] = field(default_factory=lambda: [None])
    """Holds the event recorded on the d2h stream after the last backward (SPECULATIVE,
    SPECULATIVE_UNDO): once complete, hooks leave their region to ``step()`` (see the
    SPECULATIVE tail). A new box per backward, filled once backward returns, so that
    speculative steps starting later on their own thread read their window's."""
    backward_s: tuple[float, float] | None = None
    """(start, end) of the last backward call, ``time.perf_counter()`` seconds."""


def fail_unfinished(futures: dict[int, Future[None]]) -> None:
    """Fail each of ``futures`` not completed yet: its region was never stepped."""
    for r, fut in futures.items():
        if not fut.done():
            fut.set_exception(
                RuntimeError(
                    f"region {r}'s gradients never reached the optimizer's hook, so it was "
                    "not stepped; an earlier error on the host worker says why"
                )
            )


class Overlap:
    """The overlap machine of one AMPOptimizer: the window (main thread), the mode the
    host worker is in, and the gradient hooks (see [Note: the overlap state machine])."""

    def __init__(self, optimizer: HybridAdam, controller: OffloadController) -> None:
        self.optimizer = optimizer
        self.controller = controller
        self.window = Window()
        self.host_mode = OverlapMode.NONE
        """The mode of the backward whose hooks run now (host worker only)."""
        self.host_window: AnswerWindow | None = None
        """DEVICE_ANSWER: the answer window those hooks answer to (host worker only)."""
        # Functions of the class, not methods bound to self: a dict of bound methods would
        # make this object a reference cycle, which only the cyclic collector frees (and
        # with it the controller and the device memory it holds).
        self._host_hooks: dict[OverlapMode, Callable[[Overlap, int, Window], None]] = {
            OverlapMode.NONE: _nothing,
            OverlapMode.SPECULATIVE: Overlap._step_early,
            OverlapMode.PARTIALS: Overlap._host_partial,
            OverlapMode.SPECULATIVE_UNDO: Overlap._speculate,
        }
        """What a host-state region's hook does in each mode (DEVICE_ANSWER: see
        :meth:`_answered_landing`)."""

    # ---- the main thread -----------------------------------------------------------

    def enter(self, mode: OverlapMode) -> None:
        """Main thread, a backward about to run: move the window to ``mode`` and queue the
        same change on the host worker, behind the previous micro-batch's gradient work
        (the hooks of that backward still see the old mode, those of this one the new)."""
        w = self.window
        w.mode = transition(w.mode, mode)
        w.done_box = [None]
        answer_window = AnswerWindow() if mode is OverlapMode.DEVICE_ANSWER else None
        w.answer_window = answer_window
        self.controller.submit_host(lambda: self._set_host_mode(mode, answer_window))

    def backward_done(self) -> None:
        """Main thread, the backward returned: every gradient copy of it is queued on d2h
        by now; record the event a hook checks for the SPECULATIVE tail."""
        w = self.window
        if w.mode in EARLY_STEPS:
            w.done_box[0] = self.controller.streams.d2h.record()

    def close(self) -> Window:
        """Main thread, ``step()`` or ``zero_grad()``: close the window (its mode back to
        NONE) and start a new one; returns the closed one."""
        closed = self.window
        transition(closed.mode, OverlapMode.NONE)
        self.window = Window()
        return closed

    # ---- the hooks -----------------------------------------------------------------

    def _set_host_mode(self, mode: OverlapMode, answer_window: AnswerWindow | None) -> None:
        self.host_mode = mode
        self.host_window = answer_window
        if answer_window is not None:
            answer_window.mode_set.set()  # every hook of the earlier micro-batches has run

    def on_device_grads(self, r: int, grads: list[torch.Tensor]) -> None:
        """Device grad hook (backward thread): a host-state region's partials of the global
        answer (overflow check or gradient norm), taken before its gradients are copied to
        the host (see ``Window.device_answer``)."""
        w = self.window
        if w.device_answer and self.optimizer.has_region(r):
            parts = partials_of(grads, w.norm_type, w.as_norm)
            w.device_current.add(r)
            earlier = w.device_parts.get(r)
            if earlier is not None:
                # An accumulated overflow check: L1 partials add up, finite exactly when
                # every micro-batch's are (at most 65504 per element and micro-batch).
                parts = [a + b for a, b in zip(earlier, parts, strict=True)]
            w.device_parts[r] = parts

    def on_grad_ready(self, r: int) -> None:
        """Grad-ready hook: host worker (host-state regions) or backward thread (others)."""
        optimizer = self.optimizer
        host_state = optimizer.has_region(r) and optimizer.region_storage(r).host_state
        mode = self.host_mode
        if mode is OverlapMode.DEVICE_ANSWER and host_state:
            answer_window = self.host_window
            assert answer_window is not None, "DEVICE_ANSWER hooks run with their window set"
            self._answered_landing(r, answer_window)
            return
        w = self.window
        w.notified.add(r)
        if not host_state:
            return
        if mode is not OverlapMode.NONE and optimizer.region_storage(r).streamed:
            # The backward before a step: its first streamed region to land opens the
            # ring ([Note: staging the state in backward] in streamed/ring.py).
            optimizer.stage_streamed_state()
        self._host_hooks[mode](self, r, w)

    def _step_early(self, r: int, w: Window) -> None:
        """SPECULATIVE: step host-state region ``r`` now, unless backward is over on the
        device (``step()`` queues it in forward order then) or it is streamed."""
        done = w.done_box[0]
        if done is not None and done.query():
            return  # backward is over on the device: step() queues r in forward order
        if self.optimizer.region_storage(r).streamed:
            return  # stepped on the device after backward: step() queues it
        with torch.profiler.record_function(f"host step {r} (hook)"):
            stepped = self.optimizer.step_region(r, hypers=w.hypers, timings=w.timings)
        if stepped:
            w.stepped.add(r)

    def _speculate(self, r: int, w: Window) -> None:
        """SPECULATIVE_UNDO: step host-state region ``r`` speculatively (here or on the
        speculation thread) while backward still runs on the device and the region has
        buffers for it; its partial of the answer is the device's, else taken here."""
        done = w.done_box[0]
        if self.optimizer.can_speculate(r) and (done is None or not done.query()):
            # The window's own containers: with the speculation thread
            # the step may end after step() has started the next window.
            early_steps, partials = w.stepped, w.partials

            def note(region: int, part: torch.Tensor) -> None:
                early_steps.add(region)
                partials[region] = part

            box = w.done_box  # this window's

            def backward_over() -> bool:
                event = box[0]
                return event is not None and event.query()

            self.optimizer.submit_speculation(
                r,
                w.spec_scale,
                hypers=w.hypers,
                timings=w.timings,
                stop=backward_over,
                stepped=note,
            )
        # Backward is over on the device (or the region has no buffers for a
        # speculative step, or its step is left to the speculation thread): the
        # region steps after the answer, as in PARTIALS, unless it stepped. Its
        # partial is the device's when the window takes them, else computed here.
        if not w.device_answer:
            self._host_partial(r, w)

    def _host_partial(self, r: int, w: Window) -> None:
        """PARTIALS: region ``r``'s partial of the answer, from its host accumulator."""
        grad = self.optimizer.region_grad(r)
        w.partials[r] = partials_of([grad], w.norm_type, w.as_norm)[0]

    def _answered_landing(self, r: int, answer_window: AnswerWindow) -> None:
        """Host worker, DEVICE_ANSWER: host-state region ``r``'s gradients landed. Before
        ``step()`` has the answer, leave ``r`` to it; after, step ``r`` here (unless the
        step is skipped), so regions whose gradients land after backward step as they
        land instead of after the last one."""
        with answer_window.lock:
            answer = answer_window.answer
            if answer is None:
                # Landed before the answer: step() queues it. The window is still open on
                # the main thread: step() sets the answer under this lock before it closes
                # the window.
                self.window.notified.add(r)
                answer_window.landed.add(r)
                return
        fut = answer.futures.get(r)
        if answer.skip or fut is None:
            return
        try:
            # A streamed region is only issued here: its future completes once its
            # downloads land, at a later hook or behind the last (see hand_over).
            with torch.profiler.record_function(f"host step {r} (landed after the answer)"):
                self.optimizer.issue_region(
                    r,
                    answer.grad_scale,
                    hypers=answer.hypers,
                    timings=answer.timings,
                    published=functools.partial(fut.set_result, None),
                )
        except BaseException as exc:
            # Not re-raised here: like a failed queued step, it surfaces at the region's
            # next forward or at the next wait for host work, not at zero_grad().
            if not fut.done():
                fut.set_exception(exc)

    # ---- DEVICE_ANSWER, the step taken ---------------------------------------------

    def hand_over(
        self,
        answer_window: AnswerWindow,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper],
        timings: list[RegionStepTiming],
        step_regions: Callable[[set[int]], dict[int, Future[None]]],
    ) -> dict[int, Future[None]]:
        """Main thread, ``step()`` of a DEVICE_ANSWER window that steps: hand each
        host-state region whose gradients are still in flight to its hook, and queue the
        rest (landed ones, device-state regions, plain parameters) with ``step_regions``,
        as ``step()`` always does. Returns every host step's future."""
        w = self.window
        with answer_window.lock:
            # Device partials are taken for host-state regions only: those of the last
            # backward whose gradients have not landed yet are in flight.
            in_flight = sorted(w.device_current - answer_window.landed)
            handed = self.controller.expect_updates(in_flight)
            answer_window.answer = Answer(False, grad_scale, hypers, timings, handed)
            # Landed ones, device-state regions, and (accumulating) host-state regions
            # whose gradients came from earlier micro-batches only.
            queued = w.notified - set(in_flight)
        futures = step_regions(queued)
        # Behind every hook of this backward (one FIFO worker): the streamed regions the
        # hooks issued are published once landed, and a hook that never ran (its
        # gradient task failed first) must not leave its region's forward waiting.
        self.controller.submit_host(functools.partial(self._close_window, handed))
        futures.update(handed)
        return futures

    def _close_window(self, handed: dict[int, Future[None]]) -> None:
        """Host worker, behind every hook of a DEVICE_ANSWER window: publish the
        streamed regions still landing (waiting for them), then fail the futures of
        regions whose hooks never stepped them."""
        try:
            self.optimizer.publish_streamed(wait=True)
        finally:
            fail_unfinished(handed)


def _nothing(overlap: Overlap, r: int, w: Window) -> None:
    """NONE: a host-state region's hook does nothing (accumulating, or no overlap)."""
