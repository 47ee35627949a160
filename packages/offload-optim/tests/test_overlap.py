"""Host steps that overlap the next forward give the results of stepping synchronously.

Every module here runs its host work on the runtime's worker thread (``host_worker=True``,
the path CUDA machines take) over a plan that mixes every region kind. ``overlap=False`` is
the synchronous reference: every region steps in ``step()``, which waits for them. With
``overlap=True``, ``step()`` returns while host-state regions still step on the worker, and
the next forward waits for each region (see [Note: overlapping the host step with
backward] in overlap.py). Region steps are independent of each other, so the results must be
equal bit for bit, whatever the threads' timing.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from optim_helpers import (
    batch,
    loss_of,
    masters,
    offload_module,
    overflow_on_device,
    tiny_gpt2,
)

from offload_optim import AMPOptimizer, HybridAdam, OverlapMode
from offload_optim.overlap import transition
from offload_runtime import OffloadConfig
from offload_runtime.module import OffloadModule
from offload_solver import PlanOptions

LR = 1e-2
WD = 0.01
STEPS = 6


@dataclass(frozen=True)
class Options:
    """One training configuration."""

    dtype: torch.dtype = torch.float32
    micro: int = 1
    """Micro-batches accumulated per step."""
    clipping: float = 0.0
    schedule: bool = False
    """A LambdaLR scheduler that changes the lr after every step."""
    poison_step: int | None = None
    """Step whose backward puts an inf into a host-state region's gradients (fp16)."""
    poison_micro: int | None = None
    """The one micro-batch of ``poison_step`` that overflows (default: every one)."""
    eval_forward: bool = False
    """An eval-mode forward (no grad) after every step."""


@dataclass
class Outcome:
    losses: list[float]
    evals: list[float]
    step_counts: list[int]
    scales: list[float]
    masters: dict[str, torch.Tensor]
    state: list[torch.Tensor]
    modes: set[OverlapMode]


class Trainer:
    """An OffloadModule on the worker-thread path, its AMPOptimizer and a scheduler."""

    def __init__(self, opts: Options, overlap: bool, *, host_worker: bool = True) -> None:
        self.opts = opts
        self.module = offload_module(
            tiny_gpt2(),
            batch(0),
            dtype=opts.dtype,
            host_worker=host_worker,
            options=PlanOptions(overlap=overlap),
            config=OffloadConfig(dtype=opts.dtype, accumulation_steps=opts.micro),
        )
        self.target = next(st.index for st in self.module.storages if st.host_state and st.index)
        self.poison = False
        overflow_on_device(self.module, lambda r: self.poison and r == self.target)
        self.amp = AMPOptimizer(
            HybridAdam(self.module.parameters(), lr=LR, weight_decay=WD),
            self.module,
            hysteresis=1,
            clipping_norm=opts.clipping,
        )
        self.sched = (
            torch.optim.lr_scheduler.LambdaLR(self.amp, lambda s: 1.0 / (1.0 + s))
            if opts.schedule
            else None
        )

    def backward(self, step: int, before_last: Callable[[], None] | None = None) -> float:
        """Every micro-batch of ``step``: forward and backward; returns the summed loss.
        ``before_last`` runs right before the last micro-batch's backward."""
        total = 0.0
        for k in range(self.opts.micro):
            self.poison = step == self.opts.poison_step and self.opts.poison_micro in (None, k)
            b = batch(step * self.opts.micro + k)
            loss = loss_of(self.module(**b), b["input_ids"]) / self.opts.micro
            if before_last is not None and k == self.opts.micro - 1:
                before_last()
            self.amp.backward(loss)
            total += loss.item()
        return total

    def after_step(self) -> None:
        if self.sched is not None:
            self.sched.step()

    def sched_state(self) -> dict[str, Any]:
        assert self.sched is not None
        return self.sched.state_dict()

    def eval_loss(self) -> float:
        self.module.eval()
        try:
            with torch.no_grad():
                b = batch(1000)
                return loss_of(self.module(**b), b["input_ids"]).item()
        finally:
            self.module.train()

    def train(self, steps: range) -> Outcome:
        out = Outcome([], [], [], [], {}, [], set())
        for step in steps:
            self.amp.zero_grad()
            out.losses.append(self.backward(step))
            self.amp.step()
            self.after_step()
            # Read on this thread without waiting for the queued host steps.
            out.step_counts.append(self.amp.step_count)
            out.scales.append(self.amp.loss_scale)
            if self.opts.eval_forward:
                out.evals.append(self.eval_loss())
        report = self.amp.last_step
        assert report is not None
        out.modes.add(report.overlap)
        out.masters = masters(self.module)
        self.amp.synchronize()  # reading amp.state directly needs it
        out.state = [t.clone() for st in self.amp.state.values() for t in st.values()]
        return out

    def close(self) -> None:
        self.module.close()


def run(opts: Options, overlap: bool) -> Outcome:
    trainer = Trainer(opts, overlap)
    try:
        return trainer.train(range(STEPS))
    finally:
        trainer.close()


def assert_same(a: Outcome, b: Outcome) -> None:
    assert a.losses == b.losses
    assert a.evals == b.evals
    assert a.step_counts == b.step_counts
    assert a.scales == b.scales
    for name, value in a.masters.items():
        assert torch.equal(value, b.masters[name]), name
    assert len(a.state) == len(b.state)
    assert all(torch.equal(x, y) for x, y in zip(a.state, b.state, strict=True))


CASES = {
    "fp32": Options(),
    "fp32_eval_forward": Options(eval_forward=True),
    "fp32_accumulate": Options(micro=3),
    "fp32_clip": Options(clipping=0.5),
    "fp32_schedule": Options(schedule=True),
    "fp16_overflow": Options(dtype=torch.float16, poison_step=2),
    "fp16_accumulate_overflow_first_micro": Options(
        dtype=torch.float16, micro=3, poison_step=2, poison_micro=0
    ),
    "fp16_accumulate_overflow_last_micro_schedule": Options(
        dtype=torch.float16, micro=2, poison_step=3, poison_micro=1, schedule=True
    ),
    "fp16_accumulate_clip_schedule_eval": Options(
        dtype=torch.float16, micro=2, clipping=0.5, schedule=True, eval_forward=True
    ),
    "bf16_accumulate_schedule": Options(dtype=torch.bfloat16, micro=2, schedule=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_training_equals_synchronous_training(name: str) -> None:
    opts = CASES[name]
    overlapped = run(opts, overlap=True)
    synchronous = run(opts, overlap=False)
    assert_same(overlapped, synchronous)
    needs_answer = opts.dtype == torch.float16 or opts.clipping > 0
    want = OverlapMode.PARTIALS if needs_answer else OverlapMode.SPECULATIVE
    if needs_answer and (opts.micro == 1 or opts.clipping == 0):
        # The answer's partials taken on the device: a norm for one micro-batch, the
        # overflow check (summed over micro-batches) for any number.
        want = OverlapMode.DEVICE_ANSWER
    assert overlapped.modes == {want}
    assert synchronous.modes == {OverlapMode.NONE}
    if opts.poison_step is not None:
        # The forced overflow skipped exactly its step and halved the scale (hysteresis 1).
        counts = overlapped.step_counts
        assert counts[opts.poison_step] == counts[opts.poison_step - 1]
        assert counts[-1] == STEPS - 1
        assert overlapped.scales[opts.poison_step] == overlapped.scales[0] / 2
    else:
        assert overlapped.step_counts == list(range(1, STEPS + 1))
    if opts.schedule:
        assert len(set(overlapped.losses)) == STEPS


def test_state_dict_mid_training_resumes_identically() -> None:
    opts = Options(dtype=torch.float16, clipping=0.5, schedule=True, poison_step=4)
    first = Trainer(opts, overlap=True)
    head = first.train(range(3))
    # Saved right after step(), while its host steps may still be queued: state_dict waits.
    saved = copy.deepcopy({"amp": first.amp.state_dict(), "sched": first.sched_state()})
    tail = first.train(range(3, STEPS))
    first.close()
    resumed = Trainer(opts, overlap=True)
    resumed.amp.load_state_dict(saved["amp"])
    assert resumed.sched is not None
    resumed.sched.load_state_dict(saved["sched"])
    again = resumed.train(range(3, STEPS))
    resumed.close()
    assert head.step_counts == [1, 2, 3]
    assert_same(again, tail)
    synchronous = run(opts, overlap=False)
    assert head.losses + tail.losses == synchronous.losses


class Blocker:
    """A host-worker task that holds the worker until released (or 20 s pass)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.timed_out = False

    def __call__(self) -> None:
        self.started.set()
        if not self.release.wait(timeout=20.0):
            self.timed_out = True


def host_masters(module: OffloadModule) -> dict[int, torch.Tensor]:
    """Host-state regions' masters, read without waiting (only for these tests)."""
    return {st.index: st.master.clone() for st in module.storages if st.host_state}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_step_returns_before_host_steps_and_the_next_forward_waits(set_to_none: bool) -> None:
    """fp16 (DEVICE_ANSWER, every gradient landed before step(), so no region steps in
    its hook): step(), lr schedule and zero_grad() go on while the host steps wait in the
    worker's queue; the next forward waits for them; nothing differs."""
    opts = Options(dtype=torch.float16, schedule=True)
    reference = Trainer(opts, overlap=False)
    expected = reference.train(range(3))
    reference.close()

    trainer = Trainer(opts, overlap=True)
    losses = []
    for step in range(3):
        trainer.amp.zero_grad(set_to_none)
        losses.append(trainer.backward(step))
        trainer.module.controller.wait_gradients()
        blocker = Blocker()
        trainer.module.controller.submit_host(blocker)  # after the gradient work
        before = host_masters(trainer.module)
        trainer.amp.step()
        trainer.after_step()  # the lr changes now; the queued steps must use the old one
        trainer.amp.zero_grad(set_to_none)
        # None of this waited for the host steps: they are still queued behind the blocker.
        after = host_masters(trainer.module)
        assert all(torch.equal(after[r], before[r]) for r in before)
        assert not blocker.timed_out
        blocker.release.set()
        if step == 2:
            report = trainer.amp.last_step  # waits for the host steps
            assert report is not None and not report.skipped
            host = [t.region for t in report.region_steps if t.host]
            assert host == sorted(before), "every host region, stepped in forward order"
            assert report.after_step_fraction() == 1.0
            assert report.host_step_s > 0.0
    stepped = masters(trainer.module)  # waits for the host steps
    for name, value in expected.masters.items():
        assert torch.equal(stepped[name], value), name
    assert losses == expected.losses
    trainer.close()


ANSWER_CASES = {
    "fp16_overflow": Options(dtype=torch.float16, schedule=True, poison_step=2),
    "fp16_clip_overflow": Options(dtype=torch.float16, clipping=0.5, poison_step=1),
    "bf16_clip": Options(dtype=torch.bfloat16, clipping=0.5, schedule=True),
    "fp16_accumulate_overflow_first_micro": Options(
        dtype=torch.float16, micro=2, schedule=True, poison_step=2, poison_micro=0
    ),
}


@pytest.mark.parametrize("name", list(ANSWER_CASES))
def test_regions_landing_after_the_answer_step_in_their_hooks(name: str) -> None:
    """DEVICE_ANSWER: the answer (overflow check, gradient norm) comes from partials taken
    on the device, so step() knows it while every host-state region's gradients are still
    queued (held behind a blocker submitted as the last backward copies its first host-state
    region's gradients). Those regions then step in
    their own hooks, in landing (backward) order, with the clip factor; an overflowing step
    steps nothing. Every loss, master and moment equals synchronous training bit for bit."""
    opts = ANSWER_CASES[name]
    steps = 4
    reference = Trainer(opts, overlap=False)
    expected = reference.train(range(steps))
    reference.close()

    trainer = Trainer(opts, overlap=True)
    host = sorted(host_masters(trainer.module))
    armed: list[Blocker] = []

    def hold_from_first_region(r: int, grads: list[torch.Tensor]) -> None:
        # The last backward's first host-state region, before its copy is queued: the
        # blocker holds every hook of that backward, and nothing queued before it (the
        # earlier micro-batches' hooks, the window's mode).
        if armed:
            trainer.module.controller.submit_host(armed.pop())

    trainer.module.controller.add_device_grad_hook(hold_from_first_region)
    losses, orders, skipped = [], [], []
    for step in range(steps):
        trainer.amp.zero_grad()
        blocker = Blocker()
        losses.append(trainer.backward(step, before_last=functools.partial(armed.append, blocker)))
        before = host_masters(trainer.module)
        trainer.amp.step()
        trainer.after_step()  # the lr changes now; the hooks must step with the old one
        after = host_masters(trainer.module)
        assert all(torch.equal(after[r], before[r]) for r in before), "hooks still held"
        blocker.release.set()
        report = trainer.amp.last_step  # waits for the hooks' steps
        assert report is not None and report.overlap is OverlapMode.DEVICE_ANSWER
        assert report.speculated_regions == 0, "hooks stepped only after the answer"
        assert not blocker.timed_out
        if opts.clipping > 0:
            assert report.clip_coef < 1.0 or report.skipped, "the clip factor is used"
        skipped.append(report.skipped)
        orders.append([t.region for t in report.region_steps if t.host])
    assert skipped == [step == opts.poison_step for step in range(steps)]
    for step in range(steps):
        want = [] if skipped[step] else sorted(host, reverse=True)
        assert orders[step] == want, "stepped as they landed"
    assert losses == expected.losses
    stepped = masters(trainer.module)
    for name_, value in expected.masters.items():
        assert torch.equal(stepped[name_], value), name_
    trainer.amp.synchronize()
    state = [t.clone() for st in trainer.amp.state.values() for t in st.values()]
    assert all(torch.equal(x, y) for x, y in zip(state, expected.state, strict=True))
    trainer.close()


def test_forward_waits_for_each_region_it_uses() -> None:
    """The next forward blocks on a region whose host step has not run yet."""
    trainer = Trainer(Options(clipping=0.5), overlap=True)
    trainer.backward(0)
    # Every gradient lands (its hook runs) before the blocker: a hook still queued when
    # step() takes the answer would step its region itself, ahead of the blocker, and the
    # forward would have nothing to wait for (seen once in a fresh-clone CI run).
    trainer.module.controller.wait_gradients()
    blocker = Blocker()
    trainer.module.controller.submit_host(blocker)
    trainer.amp.step()
    trainer.amp.zero_grad()
    waited_before = trainer.module.controller.update_wait_s
    # The forward must block in region waits until the worker is released.
    timer = threading.Timer(1.0, blocker.release.set)
    timer.start()
    trainer.backward(1)
    # It could not finish before the release, and it did block (no wall-clock bound: a
    # loaded machine makes those flaky).
    assert blocker.release.is_set()
    timer.join()
    assert trainer.module.controller.update_wait_s > waited_before
    assert not blocker.timed_out
    trainer.amp.step()
    trainer.close()


def test_speculative_tail_steps_in_forward_order() -> None:
    """bf16/fp32: hooks that run once backward is over leave their region to step(), which
    queues those regions in forward order (region 0, needed first, steps first)."""
    inline = Trainer(Options(), overlap=True, host_worker=False)
    for step in range(2):  # the first step's backward steps nothing early
        inline.amp.zero_grad()
        inline.backward(step)
        inline.amp.step()
    in_hooks = inline.amp.last_step
    assert in_hooks is not None
    order = [t.region for t in in_hooks.region_steps if t.host]
    assert order == sorted(order, reverse=True), "inline hooks step in backward order"
    assert in_hooks.speculated_regions == len(order), "every host region stepped in its hook"
    expected = masters(inline.module)
    inline.close()

    threaded = Trainer(Options(), overlap=True)
    threaded.backward(0)
    threaded.amp.step()
    threaded.amp.zero_grad()
    blocker = Blocker()
    threaded.module.controller.submit_host(blocker)
    threaded.backward(1)  # every hook waits behind the blocker until backward has returned
    blocker.release.set()
    threaded.amp.step()
    report = threaded.amp.last_step
    assert report is not None and report.overlap is OverlapMode.SPECULATIVE
    host = [t.region for t in report.region_steps if t.host]
    assert host == sorted(order), "all deferred, then stepped in forward order"
    assert report.speculated_regions == 0
    assert not blocker.timed_out
    got = masters(threaded.module)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    threaded.close()


@pytest.mark.parametrize("path", ["queued", "hook"])
def test_error_in_a_queued_step_surfaces_at_the_next_wait(path: str) -> None:
    """A host step that fails after step() returned (queued by step(), or run by the hook of
    a region landing after the answer) does not fail zero_grad(); the forward that reaches
    the region raises it. A queued task also fails the next wait for host work."""
    trainer = Trainer(Options(clipping=0.5), overlap=True)  # DEVICE_ANSWER
    controller = trainer.module.controller
    original = controller.publish
    bad = trainer.target

    def publish(r: int) -> None:
        if r == bad and threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"publish of region {r} failed")
        original(r)

    controller.publish = publish  # type: ignore[method-assign]
    blocker = Blocker()
    if path == "hook":
        controller.submit_host(blocker)  # every hook runs after step() has the answer
    trainer.backward(0)
    if path == "queued":
        controller.wait_gradients()  # every region landed: step() queues them all
    trainer.amp.step()  # returns: the failing step is not waited for
    blocker.release.set()
    trainer.amp.zero_grad()
    with pytest.raises(RuntimeError, match=f"publish of region {bad} failed"):
        trainer.backward(1)  # the forward reaches the region and waits for its step
    if path == "queued":
        with pytest.raises(RuntimeError, match="failed"):
            trainer.amp.synchronize()
    else:
        trainer.amp.synchronize()  # the hook reported it through the region's future only
    controller.publish = original  # type: ignore[method-assign]
    trainer.module.close()  # the error was raised already; nothing is left queued


def test_zero_grad_keeping_tensors_zeroes_every_gradient_after_the_queued_steps() -> None:
    trainer = Trainer(Options(clipping=0.5), overlap=True)
    trainer.backward(0)
    trainer.amp.step()
    trainer.amp.zero_grad(set_to_none=False)
    grads = dict(trainer.module.named_gradients())  # waits for the host worker
    assert grads and all(int(torch.count_nonzero(g)) == 0 for g in grads.values())
    assert all(p.grad is not None for p in trainer.module.parameters())
    # The zeroed accumulators are summed into (not overwritten): still exact.
    trainer.backward(1)
    trainer.amp.step()
    got = masters(trainer.module)
    trainer.close()
    reference = Trainer(Options(clipping=0.5), overlap=False)
    expected = reference.train(range(2))
    reference.close()
    for name, value in expected.masters.items():
        assert torch.equal(got[name], value), name


def test_a_window_enters_one_overlapping_mode_and_leaves_it_only_by_closing() -> None:
    """[Note: the overlap state machine] in overlap.py: from NONE a backward may enter any
    mode, any mode closes back to NONE, and nothing else is in the table."""
    for mode in OverlapMode:
        assert transition(OverlapMode.NONE, mode) is mode
        assert transition(mode, OverlapMode.NONE) is OverlapMode.NONE
    for current in OverlapMode:
        for new in OverlapMode:
            if OverlapMode.NONE not in (current, new):
                with pytest.raises(AssertionError, match=f"{current.name} -> {new.name}"):
                    transition(current, new)
