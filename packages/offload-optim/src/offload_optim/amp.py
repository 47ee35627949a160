"""AMPOptimizer: loss scaling, overflow skip, clipping, accumulation and checkpoints
over a HybridAdam, with host steps that overlap backward and the next forward.

Where each job lives: loss scaling in scaler.py (:class:`DynamicLossScaler`); the global
answers (overflow check, gradient norm) and clipping in clipping.py; the overlap of host
steps with backward, its modes as a state machine and the gradient hooks in overlap.py
([Note: overlapping the host step with backward], [Note: the overlap state machine]);
what a step did in reports.py (:class:`StepReport`). Accumulation is the window's
micro-batch count (``overlap.Window``); checkpoints are :meth:`AMPOptimizer.state_dict`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, overload

import torch

from offload_optim.clipping import clip_coefficient, combine
from offload_optim.hybrid_adam import HybridAdam
from offload_optim.overlap import (
    EARLY_STEPS,
    Answer,
    AnswerWindow,
    Overlap,
    OverlapMode,
    Window,
    choose_mode,
)
from offload_optim.reports import Pending, RegionStepTiming, StepReport, completed
from offload_optim.scaler import DynamicLossScaler
from offload_runtime.distributed import across_ranks, share_updates
from offload_runtime.host_kernels import AdamHyper
from offload_runtime.module import OffloadModule

__all__ = ["AMPOptimizer", "OverlapMode", "StepReport"]


@dataclass
class _Outcome:
    """What :meth:`AMPOptimizer.step` decided and started for a window."""

    loss_scale: float
    grad_norm: float | None = None
    clip_coef: float = 1.0
    skipped: bool = False
    undone: int = 0
    speculated: int = 0
    committed: list[int] | None = None
    """SPECULATIVE_UNDO, the step taken: filled by the host task with the regions whose
    speculative steps it commits."""
    futures: dict[int, Future[None]] = dataclasses.field(default_factory=dict)
    """The host steps queued (or handed to hooks), completed once each is published."""


class AMPOptimizer(torch.optim.Optimizer):
    """Mixed-precision training of an OffloadModule with a :class:`HybridAdam`.

    The training loop::

        amp = AMPOptimizer(HybridAdam(module.parameters(), lr=3e-4), module)
        for batch in batches:
            amp.zero_grad()
            loss = loss_fn(module(**batch))
            amp.backward(loss)            # scales fp16 losses; may start host steps
            amp.step()                    # returns before the host steps are done

    - Loss scaling: in fp16 (``module.dtype``) ``backward`` multiplies the loss by the
      dynamic scale (see :class:`DynamicLossScaler` for the rule and its hysteresis). bf16
      and fp32 train unscaled and never skip.
    - Overflow: inf or nan in any gradient (host or device) skips the whole step.
    - Clipping: ``clipping_norm > 0`` clips the global ``norm_type`` norm of all gradients
      like ``torch.nn.utils.clip_grad_norm_``; :meth:`clip_grad_norm` does it on demand
      (see [Note: clipping on demand]).
    - Accumulation: ``accumulation_steps=k`` means ``k`` calls of ``backward`` per ``step``;
      gradients are summed in fp32 and nothing steps in between. Divide each micro-batch
      loss by ``k`` yourself if you want the mean.
    - What the plan chose (``module.plan.options``): whether host steps overlap backward
      and the next forward (``overlap``; see [Note: overlapping the host step with
      backward] in overlap.py; without it everything steps after backward and the step
      waits, the reference's behaviour), and whether fp16 host-state regions step
      speculatively under backward (``speculative``: undone exactly in a step that
      overflows, :attr:`OverlapMode.SPECULATIVE_UNDO`; results are those of the plain
      steps bit for bit; for the ``speculative_params`` parameters of the regions whose
      gradients land first, and within 90% of the host memory available at the first
      speculative backward, which a RuntimeWarning names when it leaves any out). No
      speculation with clipping (every step would be undone: the answer is taken as
      without it).
    - ``keep_reports=n`` keeps the last ``n`` steps' :class:`StepReport` for
      :meth:`recent_steps` (with every region step's start and end), where
      :attr:`last_step` holds one; for finding where the host idles between steps.
    - ``param_groups`` are the HybridAdam's own, so ``torch.optim.lr_scheduler``
      schedulers take this object (or the HybridAdam) and the step uses their lr.
    - :meth:`state_dict` holds master weights, Adam moments, the scaler and the step count.
    """

    def __init__(
        self,
        optimizer: HybridAdam,
        module: OffloadModule,
        *,
        clipping_norm: float = 0.0,
        norm_type: float = 2.0,
        accumulation_steps: int | None = None,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
        keep_reports: int = 0,
    ) -> None:
        if not isinstance(optimizer, HybridAdam):
            raise TypeError(
                f"AMPOptimizer steps a HybridAdam, got {type(optimizer).__name__}; build "
                "HybridAdam(module.parameters(), ...) and pass it"
            )
        if not clipping_norm >= 0:
            raise ValueError(f"clipping_norm={clipping_norm} must be >= 0 (0 disables clipping)")
        if not (norm_type > 0 or norm_type == math.inf):
            raise ValueError(f"norm_type={norm_type} must be > 0 or math.inf")
        planned_steps = module.config.accumulation_steps
        if accumulation_steps is None:
            accumulation_steps = planned_steps
        elif accumulation_steps != planned_steps:
            raise ValueError(
                f"AMPOptimizer(accumulation_steps={accumulation_steps}), but the module was "
                f"planned for {planned_steps} (OffloadConfig(accumulation_steps="
                f"{planned_steps})): plan with OffloadConfig(accumulation_steps="
                f"{accumulation_steps}), or leave accumulation_steps out to take the module's"
            )
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps} must be >= 1")
        if isinstance(keep_reports, bool) or not isinstance(keep_reports, int) or keep_reports < 0:
            raise ValueError(f"keep_reports={keep_reports!r} must be an int >= 0 (0 keeps none)")
        self._initialized = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share the HybridAdam's groups and state: schedulers edit these very dicts.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._initialized = True
        optimizer.bind(module)
        if module.sharding is not None and optimizer.plain_params:
            raise ValueError(
                f"data parallel: the HybridAdam steps {optimizer.plain_params} tensors that "
                "are not the module's parameters, whose gradients no rank averages; train "
                "the OffloadModule's parameters() only"
            )
        self.optimizer = optimizer
        self.module = module
        self.controller = module.controller
        self.scaling = module.dtype == torch.float16
        self.scaler = DynamicLossScaler(
            initial_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
        )
        self.clipping_norm = float(clipping_norm)
        self.norm_type = float(norm_type)
        self.accumulation_steps = int(accumulation_steps)
        options = module.plan.options
        self.overlap = options.overlap
        """Host steps overlap backward and the next forward (the plan's choice)."""
        self.speculate_fp16 = options.speculative
        """fp16 host steps start under backward, undone exactly on overflow (the plan's
        choice)."""
        self.speculative_params = options.speculative_params
        """Host-state parameters given undo buffers (None: all that fit)."""
        self.sharding = module.sharding
        """Which rank steps each region under data parallel (None: one process; see
        [Note: data parallel] in ``offload_runtime.distributed``)."""
        self.step_count = 0
        """Optimizer steps taken (skipped steps excluded)."""
        self._windows_done = 0
        """Windows :meth:`step` finished (taken or skipped) by this object."""
        self.clips_on_demand = False
        """Whether :meth:`clip_grad_norm` was ever called: from then on no host region
        steps before :meth:`step` (see [Note: clipping on demand])."""
        self.undone_steps = 0
        """Steps whose speculative host steps were undone because the gradients overflowed
        (SPECULATIVE_UNDO; 0 otherwise)."""
        self._last_step: StepReport | None = None
        # The last step's report without its region timings, the list the timings go to,
        # the host steps still queued and (SPECULATIVE_UNDO) the list of regions the host
        # task commits: last_step completes the report once they are done.
        self._pending: Pending | None = None
        # The same for the last keep_reports steps, completed by recent_steps().
        self._history: collections.deque[Pending] = collections.deque(maxlen=keep_reports)
        # The current accumulation window and the gradient hooks (overlap.py).
        self._overlap = Overlap(optimizer, self.controller)
        ref = weakref.ref(self)

        def hook(r: int) -> None:
            amp = ref()
            if amp is not None:
                amp._overlap.on_grad_ready(r)

        def device_hook(r: int, grads: list[torch.Tensor]) -> None:
            amp = ref()
            if amp is not None:
                amp._overlap.on_device_grads(r, grads)

        self.controller.add_grad_ready_hook(hook)
        self.controller.add_device_grad_hook(device_hook)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self._initialized:
            self.optimizer.add_param_group(param_group)

    # ---- properties ----------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when the module does not train in fp16)."""
        return self.scaler.scale if self.scaling else 1.0

    def _needs_answer(self) -> bool:
        return self.scaling or self.clipping_norm > 0

    def _answer_on_device(self) -> bool:
        """Whether the window's answer can come from partials taken on the device: one
        micro-batch per step (overflow check or norm), or the overflow check alone over
        any number of micro-batches (a sum of finite fp16 gradients is finite in fp32, so
        the accumulated gradients are finite exactly when every micro-batch's are; a norm
        of their sum is not a function of the micro-batches' norms)."""
        if self.accumulation_steps == 1:
            return self._needs_answer()
        return self.scaling and self.clipping_norm == 0

    # ---- backward ------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch: scale (fp16), run, and arm the grad-ready hooks."""
        w = self._overlap.window
        if w.micro >= self.accumulation_steps:
            raise RuntimeError(
                f"backward() called {w.micro + 1} times since the last step(), but "
                f"AMPOptimizer(accumulation_steps={self.accumulation_steps}) steps after "
                "every that many micro-batches: call step() (or zero_grad() to drop them)"
            )
        mode = choose_mode(
            last=w.micro + 1 == self.accumulation_steps,
            overlap=self.overlap,
            needs_answer=self._needs_answer(),
            speculate=self.speculate_fp16 and self.scaling and self.clipping_norm == 0,
            answer_on_device=self._answer_on_device(),
            # A clip_grad_norm() to come must find no region stepped early.
            early_steps=self._windows_done > 0 and not self.clips_on_demand,
        )
        # Device partials serve every window whose answer they can give, with or without
        # the overlap, so that both combine the very same partials. SPECULATIVE_UNDO takes
        # them too: a region that lands after backward then needs no host pass over its
        # gradients for the answer (its partial is already on the device).
        w.device_answer = self._answer_on_device()
        w.as_norm = self.clipping_norm > 0
        w.norm_type = self.norm_type
        if mode is OverlapMode.SPECULATIVE_UNDO:
            # Allocated once, here on the main thread, before backward (for the regions
            # whose buffers fit: the others step after the answer).
            self.optimizer.prepare_speculation(self.speculative_params)
            scale = self.scaler.scale  # step() divides by it: the scaler changes only there
            w.spec_scale = None if scale == 1.0 else scale
        w.micro += 1
        if mode in EARLY_STEPS:
            w.hypers = self.optimizer.hypers()
        self._overlap.enter(mode)
        scaled = loss.float() * self.scaler.scale if self.scaling else loss
        w.device_current = set()  # filled by this backward's device grad hooks
        start = time.perf_counter()
        self.module.backward(scaled)
        w.backward_s = (start, time.perf_counter())
        self._overlap.backward_done()

    # ---- step ----------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Finish the window: skip on fp16 overflow, else clip and step every region.

        With ``overlap`` the host-state regions' steps are queued, not waited for (see
        [Note: overlapping the host step with backward] in overlap.py). ``closure``, if
        given, runs first and must call :meth:`backward` itself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        w = self._overlap.window
        if 0 < w.micro < self.accumulation_steps:
            raise RuntimeError(
                f"step() after {w.micro} of {self.accumulation_steps} accumulated "
                "micro-batches; call backward() for the rest first (or zero_grad() to drop them)"
            )
        if w.micro == 0 and self.scaling:
            raise RuntimeError(
                "step() without AMPOptimizer.backward(loss): fp16 training must scale the loss; "
                "call amp.backward(loss) instead of loss.backward()"
            )
        mode = w.mode
        if mode is not OverlapMode.DEVICE_ANSWER:
            # Host sync point: every gradient hook of this window has run (partials
            # computed, early steps done). Steps queued by the last step() may still run.
            self.controller.wait_gradients()
        # The backward may have staged streamed state into an open ring ([Note: staging
        # the state in backward] in offload_optim/streamed/ring.py): a step that steps
        # nothing must close it.
        staged = mode is not OverlapMode.DEVICE_ANSWER and self.optimizer.stage_in_backward
        try:
            outcome = self._finish(w)
        except BaseException:
            if staged:
                self.optimizer.drop_staged()
            raise
        if staged and not outcome.futures:
            # Skipped: no task steps what was staged (a queued one would close the ring).
            self.optimizer.drop_staged()
        if self.sharding is not None and not outcome.skipped:
            # Each sharded region's owner has stepped it: every rank takes its new weights.
            self.optimizer.synchronize()
            share_updates(self.module, self.sharding)
        if self.scaling:
            self.scaler.update(outcome.skipped)
        if not outcome.skipped:
            self.step_count += 1
        self._windows_done += 1
        self._overlap.close()
        report = StepReport(
            step=self.step_count,
            skipped=outcome.skipped,
            loss_scale=outcome.loss_scale,
            grad_norm=outcome.grad_norm,
            clip_coef=outcome.clip_coef,
            overlap=mode,
            region_steps=(),
            backward_start_s=None if w.backward_s is None else w.backward_s[0],
            backward_end_s=None if w.backward_s is None else w.backward_s[1],
            step_end_s=time.perf_counter(),
            undone_regions=outcome.undone,
            speculated_regions=outcome.speculated,
        )
        self._last_step = None
        self._pending = (report, w.timings, list(outcome.futures.values()), outcome.committed)
        self._history.append(self._pending)
        return loss

    def _finish(self, w: Window) -> _Outcome:
        """:meth:`step`'s decision for window ``w`` (its gradient hooks have run, but
        those of a DEVICE_ANSWER window): refuse a changed ``lr`` where regions may have
        stepped with the old one, take the answer, then skip (undoing speculative steps)
        or queue the steps."""
        mode = w.mode
        out = _Outcome(loss_scale=self.loss_scale)
        hypers = self.optimizer.hypers()
        # Whether host regions stepped in their hooks depends on thread timing (see the
        # SPECULATIVE tail), so a changed lr is refused whenever one could have.
        early = mode in EARLY_STEPS and any(
            self.optimizer.region_storage(r).host_state
            for r in w.notified
            if self.optimizer.has_region(r)
        )
        if mode is OverlapMode.SPECULATIVE:
            if early and hypers != w.hypers:
                raise RuntimeError(
                    "hyperparameters changed between backward() and step(), but host regions "
                    "step during backward with the old ones; change the lr (e.g. "
                    "scheduler.step()) after step() and before the next backward(), or plan "
                    "without overlap (PlanForce(overlap=False))"
                )
            out.speculated = len(w.stepped)
            out.futures = self._step_regions(w.notified - w.stepped, None, hypers, w.timings)
            return out
        if mode is OverlapMode.SPECULATIVE_UNDO and early and hypers != w.hypers:
            self.optimizer.wait_speculation()
            self.optimizer.undo_speculation()
            self._overlap.close()
            raise RuntimeError(
                "hyperparameters changed between backward() and step(), but host regions "
                "stepped speculatively during backward with the old ones; the step was "
                "not taken (undone): call zero_grad() and run the batch again, and "
                "change the lr (e.g. scheduler.step()) after step() and before the next "
                "backward()"
            )
        assert mode is not OverlapMode.SPECULATIVE_UNDO or w.spec_scale == (
            None if out.loss_scale == 1.0 else out.loss_scale
        ), "speculative steps divided by another loss scale"
        window = w.answer_window if mode is OverlapMode.DEVICE_ANSWER else None
        if window is not None and w.micro > 1:
            # Accumulated: the hooks of the earlier micro-batches have run (they are
            # queued before this mark, and the last backward waited for most of them
            # already), so the window's regions are all notified; the last backward's
            # hooks may still be in flight.
            window.mode_set.wait()
        if self._needs_answer():
            self._answer(w, window, out)
        if out.skipped:
            if window is not None:
                with window.lock:
                    window.answer = Answer(True, None, hypers, w.timings, {})
            # Restores the masters the hooks stepped (SPECULATIVE_UNDO; else nothing).
            self.optimizer.wait_speculation()
            out.undone = out.speculated = len(self.optimizer.undo_speculation())
            if out.undone:
                self.undone_steps += 1
            return out
        divisor = out.loss_scale / out.clip_coef
        grad_scale = None if divisor == 1.0 else divisor
        if window is not None:
            out.futures = self._overlap.hand_over(
                window,
                grad_scale,
                hypers,
                w.timings,
                lambda queued: self._step_regions(queued, grad_scale, hypers, w.timings),
            )
        elif mode is OverlapMode.SPECULATIVE_UNDO:
            # Those stepped in their hooks are committed by the host task, once it has
            # issued the streamed regions and the speculative steps are done (on their
            # own thread with speculation_thread), and only published, in forward order
            # among the rest.
            out.committed = []
            out.futures = self._step_regions(
                w.notified, grad_scale, hypers, w.timings, committed=out.committed
            )
        else:
            out.futures = self._step_regions(w.notified, grad_scale, hypers, w.timings)
        return out

    def _answer(self, w: Window, window: AnswerWindow | None, out: _Outcome) -> None:
        """Take window ``w``'s global answer into ``out``: the gradient norm and clip
        coefficient (clipping), and whether the step is skipped (fp16 overflow). A
        DEVICE_ANSWER ``window``'s hooks still add the regions that land."""
        if window is not None:
            with window.lock:  # hooks still add the regions that land
                notified = set(w.notified)
        else:
            notified = w.notified
        total, is_norm = self._combine(
            self.norm_type,
            as_norm=self.clipping_norm > 0,
            regions=notified,
            device_parts=w.device_parts,
            partials=w.partials,
        )
        # Host sync point (once per step, after backward): the skip/clip answer decides
        # what every region does next.
        overflow = not bool(torch.isfinite(total))
        if is_norm:
            unscaled = total / out.loss_scale
            out.grad_norm = float(unscaled)
            if self.clipping_norm > 0 and not overflow:
                out.clip_coef = clip_coefficient(self.clipping_norm, unscaled)
        out.skipped = self.scaling and overflow

    def _combine(
        self,
        norm_type: float,
        *,
        as_norm: bool,
        regions: set[int],
        device_parts: dict[int, list[torch.Tensor]],
        partials: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, bool]:
        """:func:`combine` over the gradients this rank counts, then over the ranks under
        data parallel (:func:`across_ranks`): the same answer on every rank."""
        sharding = self.sharding
        total, is_norm = combine(
            self.optimizer,
            norm_type,
            as_norm=as_norm,
            regions=regions,
            device_parts=device_parts,
            partials=partials,
            replicated=sharding is None or sharding.rank == 0,
        )
        if sharding is not None:
            total = across_ranks(total, is_norm, norm_type)
        return total, is_norm

    def _step_regions(
        self,
        regions: set[int],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper],
        timings: list[RegionStepTiming],
        *,
        committed: list[int] | None = None,
    ) -> dict[int, Future[None]]:
        """Step ``regions`` and the plain parameters; host regions queued in forward order.

        ``committed``: the host task commits the speculative steps first, lists their
        regions here, and only publishes those in their turn.
        """
        return self.optimizer.step_regions(
            regions,
            grad_scale,
            wait=not self.overlap,
            hypers=hypers,
            timings=timings,
            commit=committed,
        )

    @property
    def last_step(self) -> StepReport | None:
        """What the last :meth:`step` did; None before the first.

        Waits for that step's host steps still queued (a host sync point while they run),
        since the report holds their timings, and re-raises their error.
        """
        if self._pending is not None:
            self._last_step = completed(*self._pending)
            self._pending = None
        return self._last_step

    @property
    def keep_reports(self) -> int:
        """How many steps' reports :meth:`recent_steps` keeps (the constructor's
        ``keep_reports``; 0 keeps none)."""
        return self._history.maxlen or 0

    def recent_steps(self) -> list[StepReport]:
        """What the last ``keep_reports`` steps did (the constructor's argument; skipped
        steps included), oldest first, each with its region steps' timings.

        Waits for the host steps still queued (a host sync point while they run) and
        re-raises their error, as :attr:`last_step` does. Keeping the reports costs no
        wait while training: their timings are filled in by the steps themselves. Where the
        time between one step's last host step and the next step's first goes is what
        ``benchmarks/offload_bench.py`` reads from them.
        """
        return [completed(*entry) for entry in self._history]

    def synchronize(self) -> None:
        """Wait for the host steps still queued; re-raise their first error.

        Needed only before reading optimizer state directly (``amp.state``); every other
        reader of masters or moments waits by itself.
        """
        self.controller.wait_host()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients and any unfinished accumulation window.

        Does not wait for host steps queued by :meth:`step` (see [Note: overlapping the
        host step with backward] in overlap.py); waits for host gradient work still
        running. ``set_to_none`` (default) lets the runtime overwrite each region's
        accumulator when its next gradients arrive. Speculative steps of a window dropped
        before :meth:`step` (SPECULATIVE_UNDO) are undone.
        """
        self.optimizer.zero_grad(set_to_none)  # waits for host gradient work only
        if self._overlap.window.mode is OverlapMode.SPECULATIVE_UNDO:
            # A window dropped before step(). After step() the host task commits them
            # (or step() undid them): nothing to undo, nor to wait for, here.
            self.optimizer.wait_speculation()
            self.optimizer.undo_speculation()
        self._overlap.close()

    # ---- clipping on demand --------------------------------------------------------

    # [Note: clipping on demand]
    # clip_grad_norm() must find no host region stepped with unclipped gradients. Host
    # steps taken under backward (SPECULATIVE for bf16/fp32, SPECULATIVE_UNDO for fp16)
    # therefore never run in the first window (its backward steps nothing early: a loop
    # that clips clips in its first step), nor after any clip_grad_norm() call (the
    # object then steps every region in step(), as with a configured clipping_norm's
    # answer). A loop whose first clip_grad_norm() comes in a later step, after host
    # regions stepped, is refused: fp16 speculative steps are undone exactly and the
    # gradients dropped (zero_grad(): their steps divided them by the loss scale, and an
    # fp16-I/O step of a resident region wrote its new weights over them), so the batch
    # runs again and nothing has changed; bf16/fp32 steps keep no undo, so the call clips
    # nothing and step() finishes that step unclipped. Either way every later step clips
    # exactly, and the message says so.

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the global gradient norm now, like ``torch.nn.utils.clip_grad_norm_``.

        Call between :meth:`backward` and :meth:`step`. Returns the (unscaled) total norm
        before clipping; leaves the gradients alone when it is not finite (fp16 overflow:
        the step will be skipped). See [Note: clipping on demand] for how it meets host
        steps that overlap backward.
        """
        w = self._overlap.window
        if w.micro == 0:
            raise RuntimeError("clip_grad_norm() needs gradients: call it after backward()")
        if not (norm_type > 0 or norm_type == math.inf):
            raise ValueError(f"norm_type={norm_type} must be > 0 or math.inf")
        self.controller.wait_host()
        self.optimizer.wait_speculation()  # what the hooks stepped is known
        self.clips_on_demand = True
        if w.stepped and w.mode is OverlapMode.SPECULATIVE_UNDO:
            stepped = sorted(w.stepped)
            self.zero_grad()  # undoes the speculative steps exactly, drops the gradients
            raise RuntimeError(
                f"clip_grad_norm() after a backward whose host regions {stepped} had "
                "stepped speculatively with unclipped gradients, in a loop that did not clip "
                "in its first step: those steps were undone exactly and the gradients "
                "dropped (nothing else changed): run this batch's forward and backward "
                "again. From now on clip_grad_norm() clips exactly; to clip from the first "
                "step, call it from the first step on, or pass clipping_norm=max_norm to "
                "AMPOptimizer"
            )
        if w.stepped:
            raise RuntimeError(
                f"clip_grad_norm() after a backward whose host regions {sorted(w.stepped)} "
                "already stepped with unclipped gradients (bf16/fp32 host steps overlap "
                "backward and keep no undo), in a loop that did not clip in its first step; "
                "nothing was clipped: call step() to finish this step unclipped. To clip "
                "every step, call clip_grad_norm() from the first step on, or pass "
                "clipping_norm=max_norm to AMPOptimizer; from the next step on, "
                "clip_grad_norm() clips exactly"
            )
        total, _ = self._combine(
            norm_type, as_norm=True, regions=w.notified, device_parts={}, partials={}
        )
        unscaled = total / self.loss_scale
        if bool(torch.isfinite(unscaled)):
            coef = clip_coefficient(max_norm, unscaled)
            if coef < 1.0:
                grads = [
                    self.optimizer.region_grad(r)
                    for r in sorted(w.notified)
                    if self.optimizer.has_region(r)
                ]
                grads += list(self.optimizer.plain_grads())
                torch._foreach_mul_(grads, coef)
                # Stale now: step() recomputes them from the clipped accumulators.
                w.partials = {}
                w.device_parts = {}
        return float(unscaled)

    # ---- checkpoints ---------------------------------------------------------------

    def _refuse_sharded(self, what: str, shard: bool) -> None:
        if self.sharding is not None and not shard:
            raise RuntimeError(
                f"{what}: the optimizer state is sharded over {self.sharding.world} ranks "
                "(each keeps only its regions' moments); save with "
                "offload_optim.save_distributed(amp, path) and resume with "
                "offload_optim.load_distributed(amp, path) on any number of ranks"
            )

    def state_dict(self, *, masters: bool = True, shard: bool = False) -> dict[str, Any]:
        """Master weights (fp32, CPU), Adam moments and steps, the scaler and step count.

        ``masters=False`` leaves the master weights (the ``"module"`` entry) out, for a
        checkpoint that keeps them in a weights file of its own (``OffloadTrainer``'s):
        put them back under ``"module"`` to load it. Under data parallel the optimizer
        state is sharded and this is refused unless ``shard=True`` (this rank's share:
        the moments of the regions it steps), which :func:`save_distributed` writes.
        """
        self._refuse_sharded("state_dict()", shard)
        micro = self._overlap.window.micro
        if micro:
            raise RuntimeError(
                f"state_dict() in the middle of an accumulation window ({micro} of "
                f"{self.accumulation_steps} micro-batches); save after step()"
            )
        state: dict[str, Any] = {"module": self.module.state_dict()} if masters else {}
        state["optimizer"] = self.optimizer.state_dict()
        state["scaler"] = self.scaler.state_dict()
        state["step_count"] = self.step_count
        return state

    def load_state_dict(self, state_dict: dict[str, Any], *, shard: bool = False) -> None:
        """Restore what :meth:`state_dict` saved; the next step continues the run exactly.
        ``shard=True``: under data parallel, this rank's share (:func:`load_distributed`)."""
        self._refuse_sharded("load_state_dict()", shard)
        missing = {"module", "optimizer", "scaler", "step_count"} - set(state_dict)
        if missing:
            raise ValueError(
                f"AMPOptimizer state_dict lacks {sorted(missing)}; pass what "
                "AMPOptimizer.state_dict() returned"
            )
        self.zero_grad()
        self.module.load_state_dict(state_dict["module"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["scaler"])
        self.step_count = int(state_dict["step_count"])
