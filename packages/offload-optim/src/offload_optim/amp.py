"""AMPOptimizer: loss scaling, overflow skip, clipping, accumulation and overlap.

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
   before each chunk's fused Adam (see [Note: speculative steps] in hybrid_adam.py: a
   master backup, and the new moments written to a spare pair so that the old ones stay),
   main memory sees about 32 bytes per parameter instead of 28 (plus the write-allocate
   reads of the three fresh destinations on CPUs that do not stream them), and the commit
   is a swap of references. Offered for fp16 overflow only, as
   ``AMPOptimizer(..., speculate_fp16=True)`` (:attr:`OverlapMode.SPECULATIVE_UNDO`); it
   costs 12 bytes per host-state parameter of host memory (8 with bf16 moments). Clipping
   is not speculated: its factor changes the gradients of every step, so every step would
   be undone. With torch's kernels the speculative step costs well over the plain one
   and made fp16 steps slower, so it stays off by default (measured: BENCHMARKS.md,
   Decisions, "Speculative fp16 host steps"). See [Note: speculative steps]. With
   ``HybridAdam(host_kernel="single_pass")`` the undo data is written in the step's own
   pass ([Note: single-pass host Adam] in single_pass.py).
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
     runtime's device grad hook). :meth:`step` therefore has the answer as soon as
     backward's kernels finish, not after the last gradient copy lands and the host has
     read every gradient once more. Then each host-state region whose gradients are
     still in flight steps in its own grad-ready hook as they land (in landing order),
     with the scale and clip factor :meth:`step` fixed; those that landed earlier are
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
SPECULATIVE_UNDO (fp16 without clipping, ``speculate_fp16=True``): each host-state
region's hook steps it speculatively and returns its overflow partial, read in the same
pass (``HybridAdam.speculate_region``: the sum of the gradients, not their L1 norm, since
only finiteness matters here and a sum reads faster); the step divides by the loss scale
of the backward, which is the one :meth:`step` would use. The device partials of
DEVICE_ANSWER are taken too, and :meth:`step` combines them (the device's where taken,
else the hooks') as PARTIALS does: a hook that runs once backward is over only notes its
region, with no host pass over the gradients. No overflow: the host task :meth:`step`
queues issues the streamed regions first, then commits the speculative steps (a swap of
moment references) and publishes them in forward order together with the steps of the
regions that did not speculate (the tail, below; nothing else changes), and the scale
grows as usual. With ``HybridAdam(speculation_thread=True)`` the hooks hand their
speculative steps to a thread of their own (``HybridAdam.submit_speculation``), so the
host worker keeps taking landed gradients meanwhile: :meth:`step` then waits for the
gradients, not for the speculative step in flight when backward ends, and its task waits
for that step (``HybridAdam.wait_speculation``) only after issuing the streamed regions
(on by default; measured: BENCHMARKS.md, Decisions, "Threads that issue, publish and
speculate"). Overflow: every
speculative step is undone, once it has ended (master from its backup, step counts
restored; moments never written), the step is skipped and the scale backs off:
:attr:`StepReport.undone_regions` and :attr:`AMPOptimizer.undone_steps` count it. The
result is the non-speculative result, bit for bit. Nothing is published before the commit, but
the masters change in place under backward: until :meth:`step` decides, an eval forward
or ``module.state_dict()`` would see stepped masters (those regions that upload straight
from the master, with ``convert_on_device``) next to unstepped training-dtype copies
(the others). Run such things after :meth:`step`, as the training loop does;
``amp.state_dict()`` refuses to run mid-window. :meth:`zero_grad` (or
``load_state_dict``) before :meth:`step` undoes the speculative steps. bf16 host moments
speculate the same way (widened and narrowed per chunk, no extra copy).
Speculation happens only in the backward of the last micro-batch of an accumulation
window (``accumulation_steps`` says which one), so accumulated gradients are never stepped
early. The hyperparameters an early step used are checked again in :meth:`step`: changing
a learning rate between ``backward`` and ``step`` raises instead of silently differing.

After backward, the host steps also overlap the *next forward* (with ``overlap``):
- :meth:`step` waits for the window's host gradient work (it holds the partials, and says
  which regions stepped early; DEVICE_ANSWER does not wait, see above), then queues the
  remaining host-state regions' steps on the host worker in forward order, steps the
  device-state regions on this thread, and returns without waiting. The runtime's
  ``begin_forward`` / ``upload`` / ``prefetch`` of region ``r`` waits (on the host, only
  while it still runs) for ``r``'s step and publish (``OffloadController.expect_updates``),
  so region 0 computes while later regions still step. In fp16 that is where the host
  step hides: it cannot start before backward ends.
- A queued step is fixed when queued: the hyperparameters (a scheduler may change ``lr``
  right after :meth:`step`), the loss scale and clip factor, and which segments have
  gradients. It reads the flat gradient accumulators, never ``.grad``.
- In DEVICE_ANSWER, the hooks still to run after :meth:`step` step their regions with
  what :meth:`step` fixed (hyperparameters, scale), and announce them to the runtime the
  same way; :meth:`zero_grad` waits for those hooks (they are gradient work), not for the
  queued steps behind them.
- :meth:`zero_grad` does not wait for queued steps: ``set_to_none`` only drops the
  ``.grad`` references, and the runtime overwrites each accumulator when the region's next
  gradients arrive, on the host worker, which runs them after the queued steps (one FIFO
  worker); ``set_to_none=False`` zeroes host accumulators on the worker, after the steps.
- Whatever reads master weights or optimizer state waits for the queued steps first:
  ``module.named_parameters()``, ``state_dict()`` / ``load_state_dict()`` (module and
  optimizers), ``module.close()``, :attr:`last_step` (it is completed with the steps'
  timings), :meth:`synchronize` (call it before reading ``amp.state`` directly).
- An error raised by a queued step surfaces at the next of those waits, or at the forward
  of that region.
- SPECULATIVE tail: hooks step their region (in backward order) only while the device
  still runs backward or its gradient copies, which is when the step hides under them. A
  hook that runs once the last gradient copy of the backward has landed (an event
  recorded on the d2h stream after backward, polled without blocking; so it completes
  with that copy, even while backward still computes device-state regions) leaves its
  region to :meth:`step`, which queues such
  regions in forward order: region 0, whose gradients arrive last, then steps first and
  the next forward can start while the others step. SPECULATIVE_UNDO keeps the same
  rule: such a hook steps nothing (and computes no partial: the device took it), and
  the region steps after the answer, as in PARTIALS.
``overlap=False`` is the reference's behaviour: every host region steps in :meth:`step`,
after backward, and :meth:`step` waits for them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Any, cast, overload

import torch

from offload_optim.hybrid_adam import HybridAdam, RegionStepTiming
from offload_optim.kernels import AdamHyper
from offload_optim.scaler import DynamicLossScaler
from offload_runtime.module import OffloadModule
from offload_runtime.streams import Event
from offload_solver import check_speculative_params

log = logging.getLogger(__name__)

_CLIP_EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


def _partials_of(grads: list[torch.Tensor], norm_type: float, as_norm: bool) -> list[torch.Tensor]:
    """Each gradient's share of a global answer, as 0-dim fp32 tensors on its device.

    One ``torch._foreach_norm`` call for all of ``grads`` (which share a device): a
    reduction launched per gradient made the answer CPU-bound with many small regions.
    ``as_norm``: their ``norm_type`` norms (for clipping). Otherwise their L1 norms, finite
    exactly when every element is (the overflow check): fp16 gradients are at most 65504
    per element and micro-batch, so the fp32 sum of any model that fits in memory cannot
    overflow by itself. A gradient's partial does not depend on the other tensors of the
    call (on the CPU each is reduced alone; CUDA's multi-tensor kernel reduces each
    tensor's chunks in a fixed order), so partials computed one region at a time in the
    grad-ready hooks equal those computed together after backward.
    """
    ord_ = norm_type if as_norm else 1.0
    return list(torch._foreach_norm(grads, ord_, dtype=torch.float32))


def _fail_unfinished(futures: dict[int, Future[None]]) -> None:
    for r, fut in futures.items():
        if not fut.done():
            fut.set_exception(
                RuntimeError(
                    f"region {r}'s gradients never reached the optimizer's hook, so it was "
                    "not stepped; an earlier error on the host worker says why"
                )
            )


class OverlapMode(str, Enum):
    """What the grad-ready hook of a host-state region does (see the note above)."""

    NONE = "none"
    """Nothing: accumulating micro-batches, or overlap disabled."""
    SPECULATIVE = "speculative"
    """Step the region (no global answer needed)."""
    PARTIALS = "partials"
    """Compute the region's norm partial on the host (clipping over accumulated windows);
    the region steps after backward."""
    SPECULATIVE_UNDO = "speculative_undo"
    """fp16: step the region speculatively and compute its overflow partial; the step is
    committed, or undone exactly on overflow, after backward (``speculate_fp16``)."""
    DEVICE_ANSWER = "device_answer"
    """fp16 or clipping with one micro-batch per step, or fp16 without clipping over any
    number (the default there): the region's partials of the answer are taken on the
    device before its gradients leave it (summed over micro-batches), so
    :meth:`AMPOptimizer.step` knows the answer when backward ends; the region steps in its
    hook once the answer is known (as its gradients land), else in
    :meth:`AMPOptimizer.step`'s forward-order queue."""


@dataclass
class _Answer:
    """What :meth:`AMPOptimizer.step` decided for a DEVICE_ANSWER window, for the hooks of
    host-state regions whose gradients land afterwards (read under ``_AnswerWindow.lock``)."""

    skip: bool
    grad_scale: float | None
    hypers: dict[int, AdamHyper]
    timings: list[RegionStepTiming]
    futures: dict[int, Future[None]]
    """The regions the hooks step, each completed once stepped and published."""


class _AnswerWindow:
    """A DEVICE_ANSWER window as its host-worker hooks see it. It outlives the window on
    the main thread: hooks of the last window may still run after :meth:`step` reset it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answer: _Answer | None = None
        self.landed: set[int] = set()
        """Host-state regions whose gradients of this (the window's last) backward landed
        before the answer; earlier micro-batches' landings do not count."""
        self.mode_set = threading.Event()
        """Set on the host worker when it enters this window's mode, behind every hook of
        the window's earlier micro-batches."""


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`AMPOptimizer.step` did. Times are ``time.perf_counter()`` seconds."""

    step: int
    """Optimizer steps taken so far, this one included (skipped steps do not count)."""
    skipped: bool
    """True when fp16 gradients overflowed and no parameter changed."""
    loss_scale: float
    """The scale the step's gradients carried (1.0 without loss scaling)."""
    grad_norm: float | None
    """Global gradient norm before clipping (unscaled), when it was computed."""
    clip_coef: float
    """Factor the gradients were multiplied by (1.0 when not clipped)."""
    overlap: OverlapMode
    region_steps: tuple[RegionStepTiming, ...]
    backward_start_s: float | None
    """When the last micro-batch's ``backward`` was called."""
    backward_end_s: float | None
    """When it returned (on CUDA: all kernels launched, not necessarily finished)."""
    step_end_s: float | None = None
    """When :meth:`AMPOptimizer.step` returned; host steps still queued then overlapped
    the caller's next work (the next forward)."""
    undone_regions: int = 0
    """Regions whose speculative step (SPECULATIVE_UNDO) this step undid: non-zero only in
    a skipped step. ``region_steps`` still holds those steps' timings: the work was done."""
    speculated_regions: int = 0
    """Host-state regions stepped in their hooks before the answer (SPECULATIVE_UNDO:
    committed or undone) or without one (SPECULATIVE); the others stepped after
    :meth:`AMPOptimizer.step` had the answer."""

    @property
    def host_step_s(self) -> float:
        """Total time of host-state region steps on the host (with SPECULATIVE_UNDO, the
        publishes after the commit are recorded as steps of their regions too); streamed
        regions, stepped on the device, are not counted."""
        return sum(t.duration_s for t in self.region_steps if t.on_host)

    def hidden_fraction(self, backward_end_s: float | None = None) -> float:
        """Fraction of the host step time that ran before ``backward_end_s``.

        Pass the time backward really ended on the device (after a synchronize); default
        :attr:`backward_end_s`. 1.0 when there was no host step.
        """
        end = self.backward_end_s if backward_end_s is None else backward_end_s
        total = self.host_step_s
        if total == 0.0 or end is None or self.backward_start_s is None:
            return 1.0
        hidden = 0.0
        for t in self.region_steps:
            if t.on_host:
                hidden += max(0.0, min(t.end_s, end) - max(t.start_s, self.backward_start_s))
        return hidden / total

    def after_step_fraction(self) -> float:
        """Fraction of the host step time that ran after :meth:`AMPOptimizer.step` returned.

        That part overlapped the next forward instead of delaying ``step()``; how much of
        it the forward then waited for is ``OffloadController.update_wait_s``. 0.0 when
        there was no host step.
        """
        total = self.host_step_s
        if total == 0.0 or self.step_end_s is None:
            return 0.0
        after = 0.0
        for t in self.region_steps:
            if t.on_host:
                after += max(0.0, t.end_s - max(t.start_s, self.step_end_s))
        return after / total


_Pending = tuple[StepReport, list[RegionStepTiming], list[Future[None]], list[int] | None]
"""A step's report without its region timings, the list its timings go to, its host steps
still queued, and (SPECULATIVE_UNDO, the step taken) the list of regions whose speculative
steps the host task commits."""


def _completed(
    report: StepReport,
    timings: list[RegionStepTiming],
    futures: list[Future[None]],
    committed: list[int] | None,
) -> StepReport:
    """``report`` with its region steps' timings (and the speculative steps committed),
    once its queued host steps are done (re-raises their error): what
    :attr:`AMPOptimizer.last_step` and :meth:`AMPOptimizer.recent_steps` return for a
    step."""
    for fut in futures:
        fut.result()
    if committed is None:
        return dataclasses.replace(report, region_steps=tuple(timings))
    return dataclasses.replace(
        report, region_steps=tuple(timings), speculated_regions=len(committed)
    )


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
      like ``torch.nn.utils.clip_grad_norm_``; :meth:`clip_grad_norm` does it on demand.
    - Accumulation: ``accumulation_steps=k`` means ``k`` calls of ``backward`` per ``step``;
      gradients are summed in fp32 and nothing steps in between. Divide each micro-batch
      loss by ``k`` yourself if you want the mean.
    - Overlap (``overlap=True``): host steps overlap backward and the next forward; see
      [Note: overlapping the host step with backward]. ``overlap=False`` steps everything
      after backward and waits (the reference's behaviour).
    - ``speculate_fp16=True`` (off by default: BENCHMARKS.md, Decisions, "Speculative fp16
      host steps"): in fp16 without
      clipping, host-state regions step speculatively under backward, as bf16 does, and
      are undone exactly in a step that overflows (:attr:`OverlapMode.SPECULATIVE_UNDO`);
      the results are those of the default bit for bit. It costs 12 bytes of pageable host
      memory per speculating parameter (8 with bf16 moments: a master backup and a spare
      pair of moments, allocated at the first speculative backward) and a little more host
      memory traffic per step. Regions get those buffers in the order their gradients land,
      up to ``speculative_params`` parameters (None: all host-state regions) and 90% of
      the host memory available then (a RuntimeWarning names what that left out); the
      others step after backward. Give ``solve``/``memory_optimize`` the same
      ``speculative_params`` so that the plan assumes the same regions.
      Turn it on when the fp16 host step is what the step waits for after backward (host
      state dominates and backward is long enough to hide it) and host memory has room.
      No effect in bf16 / fp32 (they speculate without it), with clipping (every step
      would be undone: the answer is taken as without it), or with ``overlap=False``.
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
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
        clipping_norm: float = 0.0,
        norm_type: float = 2.0,
        *,
        accumulation_steps: int = 1,
        overlap: bool = True,
        speculate_fp16: bool = False,
        speculative_params: int | None = None,
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
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps} must be >= 1")
        check_speculative_params(speculative_params)
        if isinstance(keep_reports, bool) or not isinstance(keep_reports, int) or keep_reports < 0:
            raise ValueError(f"keep_reports={keep_reports!r} must be an int >= 0 (0 keeps none)")
        self._initialized = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        # Share the HybridAdam's groups and state: schedulers edit these very dicts.
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._initialized = True
        optimizer.bind(module)
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
        self.overlap = overlap
        self.speculate_fp16 = bool(speculate_fp16)
        self.speculative_params = speculative_params
        self.step_count = 0
        """Optimizer steps taken (skipped steps excluded)."""
        self.undone_steps = 0
        """Steps whose speculative host steps were undone because the gradients overflowed
        (SPECULATIVE_UNDO; 0 otherwise)."""
        self._last_step: StepReport | None = None
        # The last step's report without its region timings, the list the timings go to,
        # the host steps still queued and (SPECULATIVE_UNDO) the list of regions the host
        # task commits: last_step completes the report once they are done.
        self._pending: _Pending | None = None
        # The same for the last keep_reports steps, completed by recent_steps().
        self._history: collections.deque[_Pending] = collections.deque(maxlen=keep_reports)
        # ---- the current accumulation window (reset by step() and zero_grad()) ----
        self._micro = 0
        self._window_mode = OverlapMode.NONE
        self._host_mode = OverlapMode.NONE  # read by hooks on the host worker
        self._notified: set[int] = set()  # regions whose gradients arrived in the window
        self._stepped: set[int] = set()  # regions stepped early (SPECULATIVE, _UNDO)
        self._partials: dict[int, torch.Tensor] = {}  # region -> partial (PARTIALS, _UNDO)
        self._hypers: dict[int, AdamHyper] = {}  # what early steps use (SPECULATIVE, _UNDO)
        self._spec_scale: float | None = None  # what speculative steps divide by (_UNDO)
        # Each host-state region's partials of the answer, taken on the device (backward
        # thread) in a window whose answer they give (see _answer_on_device; summed over
        # micro-batches); and, in DEVICE_ANSWER, the window its host-worker hooks answer to.
        self._device_parts: dict[int, list[torch.Tensor]] = {}
        self._device_current: set[int] = set()  # regions the last backward took them for
        self._device_answer = False  # whether this window takes them (set by backward)
        self._window: _AnswerWindow | None = None
        self._host_window: _AnswerWindow | None = None  # read by hooks on the host worker
        self._timings: list[RegionStepTiming] = []  # the window's region steps
        # Holds the event recorded on the d2h stream after the last backward (SPECULATIVE,
        # _UNDO): once complete, hooks leave their region to step() (see the note's
        # SPECULATIVE tail). A new box per backward, filled once backward() returns, so
        # that speculative steps starting later on their own thread read their window's.
        self._done_box: list[Event | None] = [None]
        self._backward_s: tuple[float, float] | None = None
        ref = weakref.ref(self)

        def hook(r: int) -> None:
            amp = ref()
            if amp is not None:
                amp._on_grad_ready(r)

        def device_hook(r: int, grads: list[torch.Tensor]) -> None:
            amp = ref()
            if amp is not None:
                amp._on_device_grads(r, grads)

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
        if self._micro >= self.accumulation_steps:
            raise RuntimeError(
                f"backward() called {self._micro + 1} times since the last step(), but "
                f"AMPOptimizer(accumulation_steps={self.accumulation_steps}) steps after "
                "every that many micro-batches: call step() (or zero_grad() to drop them)"
            )
        last = self._micro + 1 == self.accumulation_steps
        mode = OverlapMode.NONE
        if last and self.overlap:
            mode = OverlapMode.PARTIALS if self._needs_answer() else OverlapMode.SPECULATIVE
            if self.speculate_fp16 and self.scaling and self.clipping_norm == 0:
                mode = OverlapMode.SPECULATIVE_UNDO
            elif self._answer_on_device():
                mode = OverlapMode.DEVICE_ANSWER
        # Device partials serve every window whose answer they can give, with or without
        # the overlap, so that both combine the very same partials. SPECULATIVE_UNDO takes
        # them too: a region that lands after backward then needs no host pass over its
        # gradients for the answer (its partial is already on the device).
        self._device_answer = self._answer_on_device()
        if mode is OverlapMode.SPECULATIVE_UNDO:
            # Allocated once, here on the main thread, before backward (for the regions
            # whose buffers fit: the others step after the answer).
            self.optimizer.prepare_speculation(self.speculative_params)
            scale = self.scaler.scale  # step() divides by it: the scaler changes only there
            self._spec_scale = None if scale == 1.0 else scale
        self._micro += 1
        if mode in (OverlapMode.SPECULATIVE, OverlapMode.SPECULATIVE_UNDO):
            self._hypers = self.optimizer.hypers()
        self._window_mode = mode
        box: list[Event | None] = [None]
        self._done_box = box
        window = _AnswerWindow() if mode is OverlapMode.DEVICE_ANSWER else None
        self._window = window
        # Queued on the host worker, behind the previous micro-batch's gradient work: the
        # hooks of that backward still see the old mode, those of this one the new mode.
        self.controller.submit_host(lambda: self._set_host_mode(mode, window))
        scaled = loss.float() * self.scaler.scale if self.scaling else loss
        self._device_current = set()  # filled by this backward's device grad hooks
        start = time.perf_counter()
        self.module.backward(scaled)
        self._backward_s = (start, time.perf_counter())
        if mode in (OverlapMode.SPECULATIVE, OverlapMode.SPECULATIVE_UNDO):
            # Every gradient copy of this backward is queued on d2h by now.
            box[0] = self.controller.streams.d2h.record()

    def _set_host_mode(self, mode: OverlapMode, window: _AnswerWindow | None = None) -> None:
        self._host_mode = mode
        self._host_window = window
        if window is not None:
            window.mode_set.set()  # every hook of the earlier micro-batches has run

    def _on_device_grads(self, r: int, grads: list[torch.Tensor]) -> None:
        """Device grad hook (backward thread): a host-state region's partials of the global
        answer (overflow check or gradient norm), taken before its gradients are copied to
        the host (see ``_device_answer``)."""
        if self._device_answer and self.optimizer.has_region(r):
            as_norm = self.clipping_norm > 0
            parts = _partials_of(grads, self.norm_type, as_norm)
            self._device_current.add(r)
            earlier = self._device_parts.get(r)
            if earlier is not None:
                # An accumulated overflow check: L1 partials add up, finite exactly when
                # every micro-batch's are (at most 65504 per element and micro-batch).
                parts = [a + b for a, b in zip(earlier, parts, strict=True)]
            self._device_parts[r] = parts

    def _on_grad_ready(self, r: int) -> None:
        """Grad-ready hook: host worker (host-state regions) or backward thread (others)."""
        host_state = self.optimizer.has_region(r) and self.optimizer.region_storage(r).host_state
        if self._host_mode is OverlapMode.DEVICE_ANSWER and host_state:
            window = self._host_window
            assert window is not None, "DEVICE_ANSWER hooks run with their window set"
            self._answered_landing(r, window)
            return
        self._notified.add(r)
        if not host_state:
            return
        mode = self._host_mode
        if mode is not OverlapMode.NONE and self.optimizer.region_storage(r).streamed:
            # The backward before a step: its first streamed region to land opens the
            # ring ([Note: staging the state in backward] in streamed.py).
            self.optimizer.stage_streamed_state()
        if mode is OverlapMode.SPECULATIVE:
            done = self._done_box[0]
            if done is not None and done.query():
                return  # backward is over on the device: step() queues r in forward order
            if self.optimizer.region_storage(r).streamed:
                return  # stepped on the device after backward: step() queues it
            with torch.profiler.record_function(f"host step {r} (hook)"):
                stepped = self.optimizer.step_region(r, hypers=self._hypers, timings=self._timings)
            if stepped:
                self._stepped.add(r)
            return
        if mode is OverlapMode.SPECULATIVE_UNDO:
            done = self._done_box[0]
            if self.optimizer.can_speculate(r) and (done is None or not done.query()):
                # The window's own containers: with HybridAdam(speculation_thread=True)
                # the step may end after step() has started the next window.
                early_steps, partials = self._stepped, self._partials

                def note(region: int, part: torch.Tensor) -> None:
                    early_steps.add(region)
                    partials[region] = part

                box = self._done_box  # this window's

                def backward_over() -> bool:
                    event = box[0]
                    return event is not None and event.query()

                self.optimizer.submit_speculation(
                    r,
                    self._spec_scale,
                    hypers=self._hypers,
                    timings=self._timings,
                    stop=backward_over,
                    stepped=note,
                )
            # Backward is over on the device (or the region has no buffers for a
            # speculative step, or its step is left to the speculation thread): the
            # region steps after the answer, as in PARTIALS, unless it stepped. Its
            # partial is the device's when the window takes them, else computed here.
            if self._device_answer:
                return
        if mode in (OverlapMode.PARTIALS, OverlapMode.SPECULATIVE_UNDO):
            grad = self.optimizer.region_grad(r)
            as_norm = self.clipping_norm > 0
            self._partials[r] = _partials_of([grad], self.norm_type, as_norm)[0]

    def _answered_landing(self, r: int, window: _AnswerWindow) -> None:
        """Host worker, DEVICE_ANSWER: host-state region ``r``'s gradients landed. Before
        :meth:`step` has the answer, leave ``r`` to it; after, step ``r`` here (unless the
        step is skipped), so regions whose gradients land after backward step as they
        land instead of after the last one."""
        with window.lock:
            answer = window.answer
            if answer is None:
                # Landed before the answer: step() queues it. The window is still open on
                # the main thread: step() sets the answer under this lock before it resets
                # the window.
                self._notified.add(r)
                window.landed.add(r)
                return
        fut = answer.futures.get(r)
        if answer.skip or fut is None:
            return
        try:
            # A streamed region is only issued here: its future completes once its
            # downloads land, at a later hook or behind the last (see _hand_over).
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

    def _hand_over(
        self,
        window: _AnswerWindow,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper],
        timings: list[RegionStepTiming],
    ) -> dict[int, Future[None]]:
        """DEVICE_ANSWER, the step taken: hand each host-state region whose gradients are
        still in flight to its hook, and queue the rest (landed ones, device-state regions,
        plain parameters) as :meth:`step` always does. Returns every host step's future."""
        with window.lock:
            # Device partials are taken for host-state regions only: those of the last
            # backward whose gradients have not landed yet are in flight.
            in_flight = sorted(self._device_current - window.landed)
            handed = self.controller.expect_updates(in_flight)
            window.answer = _Answer(False, grad_scale, hypers, timings, handed)
            # Landed ones, device-state regions, and (accumulating) host-state regions
            # whose gradients came from earlier micro-batches only.
            queued = self._notified - set(in_flight)
        futures = self._step_regions(queued, grad_scale, hypers, timings)
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
            _fail_unfinished(handed)

    # ---- global answers ------------------------------------------------------------

    def _combine(
        self, norm_type: float, *, fresh: bool, notified: set[int] | None = None
    ) -> tuple[torch.Tensor, bool]:
        """Combine every gradient's partial: (total on the CPU, whether it is a norm).

        ``notified``: the regions whose gradients arrived (default: all of the window's);
        regions with device partials count too (DEVICE_ANSWER: their gradients may still be
        in flight). Unless ``fresh``, a host-state region's partials are its device
        partials when the window took them, else its hook's; the rest are computed here,
        one batched call per device. They are combined in region order whoever computed
        them, so that the total does not depend on the overlap. Reads one value per device
        back to the host: a sync point.
        """
        as_norm = fresh or self.clipping_norm > 0
        # Per device: (slot -> partial) in region order; missing ones computed below.
        slots: dict[torch.device, list[torch.Tensor | None]] = {}
        missing: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
        regions = self._notified if notified is None else notified
        device_parts = {} if fresh else self._device_parts
        for r in sorted(regions | set(device_parts)):
            if not self.optimizer.has_region(r):
                continue
            if r in device_parts:
                for dpart in device_parts[r]:
                    slots.setdefault(dpart.device, []).append(dpart)
                continue
            grad = self.optimizer.region_grad(r)
            part = None if fresh else self._partials.get(r)
            device_slots = slots.setdefault(grad.device, [])
            if part is None:
                where, grads = missing.setdefault(grad.device, ([], []))
                where.append(len(device_slots))
                grads.append(grad)
            device_slots.append(part)
        for g in self.optimizer.plain_grads():
            where, grads = missing.setdefault(g.device, ([], []))
            device_slots = slots.setdefault(g.device, [])
            where.append(len(device_slots))
            grads.append(g)
            device_slots.append(None)
        for device, (where, grads) in missing.items():
            for i, part in zip(where, _partials_of(grads, norm_type, as_norm), strict=True):
                slots[device][i] = part
        if not slots:
            return torch.zeros(()), as_norm
        host = torch.cat(
            [torch.stack(cast(list[torch.Tensor], parts)).to("cpu") for parts in slots.values()]
        )
        if as_norm:
            return torch.linalg.vector_norm(host, norm_type), True
        return host.sum(), False

    # ---- step ----------------------------------------------------------------------

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Finish the window: skip on fp16 overflow, else clip and step every region.

        With ``overlap`` the host-state regions' steps are queued, not waited for (see the
        note). ``closure``, if given, runs first and must call :meth:`backward` itself.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if 0 < self._micro < self.accumulation_steps:
            raise RuntimeError(
                f"step() after {self._micro} of {self.accumulation_steps} accumulated "
                "micro-batches; call backward() for the rest first (or zero_grad() to drop them)"
            )
        if self._micro == 0 and self.scaling:
            raise RuntimeError(
                "step() without AMPOptimizer.backward(loss): fp16 training must scale the loss; "
                "call amp.backward(loss) instead of loss.backward()"
            )
        mode = self._window_mode
        if mode is not OverlapMode.DEVICE_ANSWER:
            # Host sync point: every gradient hook of this window has run (partials
            # computed, early steps done). Steps queued by the last step() may still run.
            self.controller.wait_gradients()
        # The backward may have staged streamed state into an open ring ([Note: staging
        # the state in backward] in offload_optim/streamed.py): a step that steps nothing
        # must close it.
        staged = mode is not OverlapMode.DEVICE_ANSWER and self.optimizer.stage_in_backward
        futures: dict[int, Future[None]] = {}
        try:
            scale = self.loss_scale
            grad_norm: float | None = None
            coef = 1.0
            skipped = False
            timings = self._timings
            hypers = self.optimizer.hypers()
            undone = 0
            speculated = 0
            committed: list[int] | None = None  # SPECULATIVE_UNDO: filled by the host task
            # Whether host regions stepped in their hooks depends on thread timing (see the
            # SPECULATIVE tail), so a changed lr is refused whenever one could have.
            early = mode in (OverlapMode.SPECULATIVE, OverlapMode.SPECULATIVE_UNDO) and any(
                self.optimizer.region_storage(r).host_state
                for r in self._notified
                if self.optimizer.has_region(r)
            )
            if mode is OverlapMode.SPECULATIVE:
                if early and hypers != self._hypers:
                    raise RuntimeError(
                        "hyperparameters changed between backward() and step(), but host regions "
                        "step during backward with the old ones; change the lr (e.g. "
                        "scheduler.step()) after step() and before the next backward(), or build "
                        "AMPOptimizer(..., overlap=False)"
                    )
                rest = self._notified - self._stepped
                speculated = len(self._stepped)
                futures = self._step_regions(rest, None, hypers, timings)
            else:
                if mode is OverlapMode.SPECULATIVE_UNDO and early and hypers != self._hypers:
                    self.optimizer.wait_speculation()
                    self.optimizer.undo_speculation()
                    self._reset_window()
                    raise RuntimeError(
                        "hyperparameters changed between backward() and step(), but host regions "
                        "stepped speculatively during backward with the old ones; the step was "
                        "not taken (undone): call zero_grad() and run the batch again, and "
                        "change the lr (e.g. scheduler.step()) after step() and before the next "
                        "backward()"
                    )
                assert mode is not OverlapMode.SPECULATIVE_UNDO or self._spec_scale == (
                    None if scale == 1.0 else scale
                ), "speculative steps divided by another loss scale"
                window = self._window if mode is OverlapMode.DEVICE_ANSWER else None
                if window is not None and self._micro > 1:
                    # Accumulated: the hooks of the earlier micro-batches have run (they are
                    # queued before this mark, and the last backward waited for most of them
                    # already), so the window's regions are all notified; the last backward's
                    # hooks may still be in flight.
                    window.mode_set.wait()
                if self._needs_answer():
                    if window is not None:
                        with window.lock:  # hooks still add the regions that land
                            notified = set(self._notified)
                    else:
                        notified = self._notified
                    total, is_norm = self._combine(self.norm_type, fresh=False, notified=notified)
                    # Host sync point (once per step, after backward): the skip/clip answer
                    # decides what every region does next.
                    overflow = not bool(torch.isfinite(total))
                    if is_norm:
                        unscaled = total / scale
                        grad_norm = float(unscaled)
                        if self.clipping_norm > 0 and not overflow:
                            clip = (self.clipping_norm / (unscaled + _CLIP_EPS)).clamp(max=1.0)
                            coef = float(clip)
                    skipped = self.scaling and overflow
                if skipped:
                    if window is not None:
                        with window.lock:
                            window.answer = _Answer(True, None, hypers, timings, {})
                    # Restores the masters the hooks stepped (SPECULATIVE_UNDO; else nothing).
                    self.optimizer.wait_speculation()
                    undone = len(self.optimizer.undo_speculation())
                    speculated = undone
                    if undone:
                        self.undone_steps += 1
                else:
                    divisor = scale / coef
                    grad_scale = None if divisor == 1.0 else divisor
                    if window is not None:
                        futures = self._hand_over(window, grad_scale, hypers, timings)
                    elif mode is OverlapMode.SPECULATIVE_UNDO:
                        # Those stepped in their hooks are committed by the host task, once
                        # it has issued the streamed regions and the speculative steps are
                        # done (on their own thread with speculation_thread), and only
                        # published, in forward order among the rest.
                        committed = []
                        futures = self._step_regions(
                            self._notified, grad_scale, hypers, timings, committed=committed
                        )
                    else:
                        futures = self._step_regions(self._notified, grad_scale, hypers, timings)
        except BaseException:
            if staged:
                self.optimizer.drop_staged()
            raise
        if staged and not futures:
            # Skipped: no task steps what was staged (a queued one would close the ring).
            self.optimizer.drop_staged()
        if self.scaling:
            self.scaler.update(skipped)
        if not skipped:
            self.step_count += 1
        backward_s = self._backward_s
        self._reset_window()
        report = StepReport(
            step=self.step_count,
            skipped=skipped,
            loss_scale=scale,
            grad_norm=grad_norm,
            clip_coef=coef,
            overlap=mode,
            region_steps=(),
            backward_start_s=None if backward_s is None else backward_s[0],
            backward_end_s=None if backward_s is None else backward_s[1],
            step_end_s=time.perf_counter(),
            undone_regions=undone,
            speculated_regions=speculated,
        )
        self._last_step = None
        self._pending = (report, timings, list(futures.values()), committed)
        self._history.append(self._pending)
        return loss

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
            self._last_step = _completed(*self._pending)
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
        return [_completed(*entry) for entry in self._history]

    def synchronize(self) -> None:
        """Wait for the host steps still queued; re-raise their first error.

        Needed only before reading optimizer state directly (``amp.state``); every other
        reader of masters or moments waits by itself.
        """
        self.controller.wait_host()

    def _reset_window(self) -> None:
        """Start a new accumulation window (its host gradient work has finished)."""
        self._micro = 0
        self._window_mode = OverlapMode.NONE
        # Not _host_mode / _host_window: the host worker's, set in order by each backward;
        # hooks of a DEVICE_ANSWER window may still run after step() resets the window.
        self._notified = set()
        self._stepped = set()
        self._partials = {}
        self._hypers = {}
        self._spec_scale = None
        self._device_parts = {}
        self._device_current = set()
        self._device_answer = False
        self._window = None
        self._timings = []
        self._done_box = [None]
        self._backward_s = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop gradients and any unfinished accumulation window.

        Does not wait for host steps queued by :meth:`step` (see the note); waits for host
        gradient work still running. ``set_to_none`` (default) lets the runtime overwrite
        each region's accumulator when its next gradients arrive. Speculative steps of a
        window dropped before :meth:`step` (SPECULATIVE_UNDO) are undone.
        """
        self.optimizer.zero_grad(set_to_none)  # waits for host gradient work only
        if self._window_mode is OverlapMode.SPECULATIVE_UNDO:
            # A window dropped before step(). After step() the host task commits them
            # (or step() undid them): nothing to undo, nor to wait for, here.
            self.optimizer.wait_speculation()
            self.optimizer.undo_speculation()
        self._reset_window()

    # ---- clipping on demand --------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the global gradient norm now, like ``torch.nn.utils.clip_grad_norm_``.

        Call between :meth:`backward` and :meth:`step`. Returns the (unscaled) total norm
        before clipping; leaves the gradients alone when it is not finite (fp16 overflow:
        the step will be skipped).
        """
        if self._micro == 0:
            raise RuntimeError("clip_grad_norm() needs gradients: call it after backward()")
        self.controller.wait_host()
        self.optimizer.wait_speculation()  # what the hooks stepped is known
        if self._stepped:
            raise RuntimeError(
                "clip_grad_norm() after a backward whose host regions already stepped (the "
                "overlap speculates when no clipping is configured): pass "
                "clipping_norm=max_norm to AMPOptimizer, or build it with overlap=False"
            )
        if not (norm_type > 0 or norm_type == math.inf):
            raise ValueError(f"norm_type={norm_type} must be > 0 or math.inf")
        total, _ = self._combine(norm_type, fresh=True)
        unscaled = total / self.loss_scale
        if bool(torch.isfinite(unscaled)):
            clip = (max_norm / (unscaled + _CLIP_EPS)).clamp(max=1.0)
            coef = float(clip)
            if coef < 1.0:
                grads = [
                    self.optimizer.region_grad(r)
                    for r in sorted(self._notified)
                    if self.optimizer.has_region(r)
                ]
                grads += list(self.optimizer.plain_grads())
                torch._foreach_mul_(grads, coef)
                # Stale now: step() recomputes them from the clipped accumulators.
                self._partials = {}
                self._device_parts = {}
        return float(unscaled)

    # ---- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Master weights (fp32, CPU), Adam moments and steps, the scaler and step count."""
        if self._micro:
            raise RuntimeError(
                f"state_dict() in the middle of an accumulation window ({self._micro} of "
                f"{self.accumulation_steps} micro-batches); save after step()"
            )
        return {
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step_count": self.step_count,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; the next step continues the run exactly."""
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
