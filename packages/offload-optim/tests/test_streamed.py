"""Host-state regions stepped on the device ([Note: streamed steps] in streamed/__init__.py).

On the CPU the "device" is the CPU, so a streamed step is the copies into the ring's
buffers, the widening, torch's fused step and the copies back. The contract: with
``host_kernel="torch"`` a run that streams some host-state regions equals the run that
steps them on the host bit for bit (losses, masters, moments, step counts, loss scales),
with overflow skips, speculation (streamed regions never speculate), accumulation and
inline or threaded host work; with the single-pass kernel it equals it within rounding.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import test_overlap
import test_speculate
import torch
from optim_helpers import batch, loss_of, masters, offload_module, tiny_gpt2
from test_speculate import assert_same, run

import offload_optim.streamed as streamed_module
import offload_runtime.planning.streamed_costs as stream_costs
from offload_optim import AMPOptimizer, HybridAdam, OverlapMode
from offload_optim.hybrid_adam import RegionStepTiming
from offload_optim.stepping import Stepper
from offload_optim.streamed import StreamedSteps, StreamPiece, StreamRing
from offload_runtime.controller import OffloadController
from offload_runtime.host_kernels import AdamHyper, single_pass
from offload_runtime.planning.streamed_costs import (
    STREAM_CHUNK_NUMEL,
    chunk_numel_for,
    ring_shape,
    stream_copy_bytes,
    stream_slot_bytes,
    streamed_step_costs,
)
from offload_solver import PlanOptions


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Make the mixed plan's host-state regions after the first streamed (region 0 stays
    host-stepped, so both kinds step in one run), with a ring chunk small enough that
    every region takes several chunks and a ragged tail; counts the pieces issued."""
    seen: dict[str, Any] = {
        "pieces": 0,
        "streamed": [],
        "threads": set(),
        "paced": set(),
        "staged_used": 0,
        "staged_state": 0,
    }
    build = test_speculate.offload_module

    def offload_streamed(*args: Any, **kwargs: Any) -> Any:
        module = build(*args, **kwargs)
        host = [st for st in module.storages if st.host_state]
        for st in host[1:]:
            st.streamed = True
        seen["streamed"] = [st.index for st in host[1:]]
        return module

    issue = StreamRing.issue

    def counting(
        self: StreamRing, pieces: list[StreamPiece], grad_scale: float | None, **kw: Any
    ) -> Any:
        seen["pieces"] += len(pieces)
        name = threading.current_thread().name
        seen["threads"].add(name)
        seen["paced"].add((name.split("_")[0], kw.get("paced", False)))
        return issue(self, pieces, grad_scale, **kw)

    stage = StreamRing.stage

    def staging(self: StreamRing, *tensors: Any) -> bool:
        before = self.staged()
        done = stage(self, *tensors)
        seen["staged_state"] += self.staged() - before  # the state alone, in a backward hook
        return done

    close = StreamRing.close

    def closing(self: StreamRing) -> None:
        seen["staged_used"] += self.staged_used
        close(self)

    monkeypatch.setattr(test_speculate, "offload_module", offload_streamed)
    monkeypatch.setattr(StreamRing, "issue", counting)
    monkeypatch.setattr(StreamRing, "close", closing)
    monkeypatch.setattr(StreamRing, "stage", staging)
    monkeypatch.setattr(stream_costs, "STREAM_CHUNK_NUMEL", 1000)
    yield seen


CASES: dict[str, dict[str, Any]] = {
    "threaded": {},
    "inline": {"host_worker": False},
    "bf16_moments": {"moments": torch.bfloat16},
    "accumulate_2": {"micro": 2},
    "no_overlap": {"overlap": False},
    "clipping": {"clipping": 0.5},
    "bf16_training": {"dtype": torch.bfloat16},
    # Staging the state in backward: in the hooks of the last micro-batch's backward, with
    # overlap and no answer taken on the device (bf16 training; clipping's partials).
    "stage_in_backward_bf16_training": {"stage_in_backward": True, "dtype": torch.bfloat16},
    "stage_in_backward_bf16_accumulate_2": {
        "stage_in_backward": True,
        "micro": 2,
        "dtype": torch.bfloat16,
    },
    "stage_in_backward_clipping_accumulate_2": {
        "stage_in_backward": True,
        "clipping": 0.5,
        "micro": 2,
    },
    "stage_in_backward_inline": {
        "stage_in_backward": True,
        "host_worker": False,
        "dtype": torch.bfloat16,
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_streaming_equals_host_steps_bit_for_bit(name: str, streaming: dict[str, Any]) -> None:
    kwargs = CASES[name]
    growth: dict[str, Any] = {"growth_interval": 3, "initial_scale": 2.0**8}
    poison: tuple[int, ...] = (2,)
    if kwargs.get("dtype") is torch.bfloat16:  # no loss scale, nothing to skip
        growth, poison = {}, ()
    out = run(False, 7, poison=poison, **kwargs, **growth)
    assert streaming["streamed"], "the mixed plan has host-state regions to stream"
    assert streaming["pieces"] > 0
    streaming["pieces"] = 0
    with pytest.MonkeyPatch.context() as mp:  # the same run, every region host-stepped
        mp.setattr(test_speculate, "offload_module", offload_module)
        plain = run(False, 7, poison=poison, **kwargs, **growth)
    assert streaming["pieces"] == 0
    assert_same(out, plain)
    # Staged chunks were stepped from their slots, staged by the backward's hooks with
    # stage_in_backward ([Note: staging the state in backward] in streamed/ring.py), and only then.
    staging = bool(kwargs.get("stage_in_backward"))
    assert (streaming["staged_used"] > 0) == staging, out.modes
    assert (streaming["staged_state"] > 0) == staging
    if "dtype" not in kwargs:
        assert out.skipped[2] and not any(out.skipped[3:])
    # step()'s streamed regions are issued from the issuing thread, which alone paces
    # ([Note: paced ring] in streamed/ring.py); a hook issues its region (one landing
    # after the answer) on the host worker, unpaced. Without overlap every streamed
    # region is step()'s; with it, which ones land after the answer is timing, so there
    # the values are what is checked.
    paced_by = {thread for thread, paced in streaming["paced"] if paced}
    assert paced_by <= {"offload-stream-issue"}
    if kwargs.get("overlap") is False:
        assert {name.split("_")[0] for name in streaming["threads"]} == {"offload-stream-issue"}
        assert paced_by == {"offload-stream-issue"}


@pytest.mark.parametrize(
    "threads",
    [
        {"speculation_thread": True},
        {"speculation_thread": True, "stage_in_backward": True},
    ],
    ids=["speculation_thread", "staged_in_backward"],
)
def test_speculation_on_its_thread_beside_streamed_regions_is_exact(
    threads: dict[str, Any], streaming: dict[str, Any]
) -> None:
    """Speculative steps on their own thread, committed by step()'s host task after it
    has issued the streamed regions, with an overflow on the way: the run is the one with
    every region host-stepped and nothing speculated, bit for bit."""
    growth: dict[str, Any] = {"growth_interval": 3, "initial_scale": 2.0**8, "hysteresis": 1}
    out = run(True, 7, poison=(2,), **threads, **growth)
    assert streaming["pieces"] > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_speculate, "offload_module", offload_module)
        plain = run(False, 7, poison=(2,), **growth)
    assert_same(out, plain)
    assert out.skipped[2] and not any(out.skipped[3:])
    staging = bool(threads.get("stage_in_backward"))
    assert (streaming["staged_used"] > 0) == staging
    assert (streaming["staged_state"] > 0) == staging


def test_streamed_regions_do_not_speculate(streaming: dict[str, Any]) -> None:
    """With a speculative plan only the host-stepped region speculates; the streamed ones step
    after the answer. The run still equals the plain one, overflow undo included."""
    # Inline host work: each hook runs during backward, so region 0 always speculates (on
    # the worker thread its hook may come after backward's end and step after the answer).
    trainer = test_speculate.Trainer(True, hysteresis=1, host_worker=False)
    trainer.poison_steps = {2}
    try:
        out = trainer.train(range(6))
        opt = trainer.amp.optimizer
        spec = {r for r in streaming["streamed"] if opt.can_speculate(r)}
        assert spec == set(), "no streamed region has speculative buffers"
        assert opt.can_speculate(0), "the host-stepped region does"
    finally:
        trainer.close()
    assert out.undone[2] == 1, "only region 0 stepped speculatively and was undone"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_speculate, "offload_module", offload_module)
        plain = run(False, 6, poison=(2,), hysteresis=1, host_worker=False)
    assert_same(out, plain)


@pytest.mark.skipif(
    not single_pass.fp16_io_available(), reason="numba or the CPU's fp16 conversions missing"
)
def test_streaming_with_fp16_io_writes_the_upload_copy(streaming: dict[str, Any]) -> None:
    """fp16 I/O: a streamed region steps from the staged fp16 gradient and writes its
    upload copy, as the single-pass kernel does. One step from the same state: masters
    within rounding of the kernel's (torch's fused update against the single-pass one,
    about 1e-7 of an lr 1e-2 step). Later steps are not compared: a rounding difference
    in a gradient near zero flips its Adam update's sign."""
    common: dict[str, Any] = {"host_kernel": "single_pass", "fp16_io": True}
    trainer = test_speculate.Trainer(False, **common)
    try:
        out = trainer.train(range(3))
        for st in trainer.module.storages:
            if st.streamed and st.offloaded:
                assert st.host_params is not None
                assert torch.equal(st.host_params, st.master.half())
        stats = trainer.module.controller.stats
        host = [st for st in trainer.module.storages if st.host_state]
        assert stats["staged_grads_widened_late"] == 0, "no fp32 accumulator pass"
        assert stats["grads_to_staging"] == 3 * len(host)
    finally:
        trainer.close()
    assert not any(out.skipped)
    one = run(False, 1, **common)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_speculate, "offload_module", offload_module)
        plain = run(False, 1, **common)
    assert one.losses == plain.losses
    for name, value in one.masters.items():
        torch.testing.assert_close(value, plain.masters[name], rtol=0, atol=1e-8)


def test_step_reports_name_streamed_regions(streaming: dict[str, Any]) -> None:
    # Streamed regions' timings say how long issuing them took (within their span); the
    # host-stepped region's say 0.
    module = test_speculate.offload_module(
        tiny_gpt2(), batch(0), dtype=torch.float16, host_worker=True
    )
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
    try:
        for step in range(2):
            amp.zero_grad()
            b = batch(step)
            amp.backward(loss_of(module(**b), b["input_ids"]))
            amp.step()
        report = amp.last_step
        assert report is not None
        steps: dict[int, RegionStepTiming] = {t.region: t for t in report.region_steps}
    finally:
        module.close()
    for r in streaming["streamed"]:
        assert steps[r].streamed and steps[r].host and not steps[r].on_host
        assert 0 < steps[r].issue_s <= steps[r].duration_s
    assert not steps[0].streamed and steps[0].host and steps[0].on_host
    assert steps[0].issue_s == 0.0
    assert report.host_step_s == steps[0].duration_s


def test_ring_sizes() -> None:
    """Bytes per parameter over PCIe, and the ring's device bytes, with bf16 moments and
    fp16 I/O, and with fp32 moments and gradients."""
    assert stream_copy_bytes(torch.bfloat16, True) == (10, 10)
    assert stream_copy_bytes(torch.float32, False) == (16, 12)
    n = 1000
    # 3 slots x (4 + 2 + 2 + 2 + 2) + work (4 + 8)
    assert stream_slot_bytes(torch.bfloat16, True, chunk_numel=n, slots=3) == n * (3 * 12 + 12)
    assert stream_slot_bytes(torch.float32, False, chunk_numel=n, slots=2) == n * 2 * 16
    with pytest.raises(ValueError, match="must be >= 1"):
        StreamRing(torch.device("cpu"), torch.float32, False, chunk_numel=0)


def test_the_ring_is_freed_once_its_regions_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring's buffers go as soon as every streamed region of the task is published,
    not after the host steps still to come (the planner counts them until the last
    download): streaming only the second host-state region, whose device step the
    issuing thread issues, and holding the first later host-stepped region's step until
    the issuing thread is done (on a GPU a host step takes milliseconds, the issuing
    less), the ring closes before the second later region's step."""
    closed: list[float] = []
    close = StreamRing.close

    def timed(self: StreamRing) -> None:
        closed.append(time.perf_counter())
        close(self)

    monkeypatch.setattr(StreamRing, "close", timed)
    # Inline host work: every region steps in step()'s one task, in forward order (on the
    # worker thread a region landing after the answer steps in its hook instead).
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16, host_worker=False)
    host = [st for st in module.storages if st.host_state]
    assert len(host) >= 4, "the mixed plan has host-stepped regions after the streamed one"
    host[1].streamed = True
    opt = HybridAdam(module.parameters(), lr=1e-2)
    issued: list[Future[None]] = []
    elsewhere = StreamedSteps.issue_elsewhere
    step_segments = Stepper.step_segments

    def kept(self: StreamedSteps, issue: Callable[[], None]) -> Future[None]:
        issued.append(elsewhere(self, issue))
        return issued[-1]

    def after_issuing(self: Stepper, r: int, *args: Any) -> None:
        if r == host[2].index and issued:
            issued[-1].result()
        step_segments(self, r, *args)

    monkeypatch.setattr(StreamedSteps, "issue_elsewhere", kept)
    monkeypatch.setattr(Stepper, "step_segments", after_issuing)
    amp = AMPOptimizer(opt, module)
    try:
        amp.zero_grad()
        b = batch(0)
        amp.backward(loss_of(module(**b), b["input_ids"]))
        amp.step()
        report = amp.last_step
        assert report is not None
    finally:
        module.close()
    assert len(issued) == 1
    assert len(closed) == 1
    later = sorted(t.start_s for t in report.region_steps if t.host and t.region > host[1].index)
    assert len(later) >= 2
    assert closed[0] < later[1]


def test_every_ring_runs_on_the_same_streams(streaming: dict[str, Any]) -> None:
    """The caching allocator reuses a freed block only on the stream it was allocated on:
    each step's ring must run on the streams of the first, or it allocates anew."""
    seen: list[tuple[Any, Any, Any]] = []  # the objects themselves: no id reuse
    issue = StreamRing.issue

    def recording(
        self: StreamRing, pieces: list[StreamPiece], grad_scale: float | None, **kw: Any
    ) -> Any:
        seen.append((self.up, self.step, self.down))
        return issue(self, pieces, grad_scale, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamRing, "issue", recording)
        run(False, 3)
    assert len(seen) >= 3
    assert all(all(a is b for a, b in zip(s, seen[0], strict=True)) for s in seen)


def test_the_ring_is_sized_to_the_budget() -> None:
    """streamed_step_costs(budget_bytes=) keeps the ring within a tenth of the budget
    (3 GiB here), with full chunks where that allows them (24 GiB); the optimizer
    builds rings back from the plan's slot_bytes (chunk_numel_for)."""
    gib = 2**30
    w2 = streamed_step_costs(torch.float32, True, budget_bytes=3 * gib)
    assert w2.slot_bytes <= 0.1 * 3 * gib
    assert w2.slot_bytes > 0.1 * 3 * gib - stream_slot_bytes(torch.float32, True, chunk_numel=1)
    assert (w2.up_bytes_per_param, w2.down_bytes_per_param) == (14, 14)
    w4 = streamed_step_costs(torch.bfloat16, True, budget_bytes=24 * gib)
    assert w4 == streamed_step_costs(torch.bfloat16, True)
    assert chunk_numel_for(w4.slot_bytes, torch.bfloat16, True) == STREAM_CHUNK_NUMEL
    tiny = streamed_step_costs(torch.float32, False, budget_bytes=1 << 20)
    assert chunk_numel_for(tiny.slot_bytes, torch.float32, False) == 1 << 16
    assert chunk_numel_for(w2.slot_bytes + 5, torch.float32, True) == chunk_numel_for(
        w2.slot_bytes, torch.float32, True
    )
    with pytest.raises(ValueError, match="holds no element"):
        chunk_numel_for(10, torch.float32, True)
    with pytest.raises(ValueError, match="must be > 0"):
        streamed_step_costs(torch.float32, True, budget_bytes=0)


def test_staging_in_backward_is_planned_as_the_optimizer_stages() -> None:
    """streamed_step_costs counts one chunk per ring slot of master weights and moments
    going up in the backward when the optimizer stages there (the planner's default); the
    optimizer stages as its module's plan says."""
    from offload_runtime.planning.streamed_costs import with_stage_in_backward

    on = streamed_step_costs(torch.float32, False, chunk_numel=1000)
    assert (on.staged_chunks, on.staged_chunk_numel, on.staged_bytes_per_param) == (
        stream_costs.STREAM_SLOTS,
        1000,
        12.0,
    )
    off = streamed_step_costs(torch.float32, False, chunk_numel=1000, stage_in_backward=False)
    assert (off.staged_chunks, off.staged_chunk_numel, off.staged_bytes_per_param) == (0, 0, 0)
    assert with_stage_in_backward(off, torch.float32, False) == on
    assert with_stage_in_backward(on, torch.float32, False, stage=False) == off
    assert streamed_step_costs(torch.bfloat16, True, chunk_numel=1000).staged_bytes_per_param == 8
    assert not HybridAdam([torch.zeros(2, requires_grad=True)]).stage_in_backward, "unbound"
    for stage in (True, False):
        options = PlanOptions(stage_in_backward=stage)
        module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16, options=options)
        try:
            amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
            assert amp.optimizer.stage_in_backward is stage
        finally:
            module.close()


def test_a_ring_of_more_slots_is_planned_and_shaped_from_the_plan() -> None:
    """streamed_step_costs(slots=N): a ring of N buffer sets (its bytes, within the
    budget's tenth), N chunks staged in the backward, and the optimizer's ring shaped from
    the plan (ring_shape); another count than the default needs staging."""
    gib = 2**30
    five = streamed_step_costs(torch.float32, True, chunk_numel=1000, slots=5)
    assert five.slot_bytes == stream_slot_bytes(torch.float32, True, chunk_numel=1000, slots=5)
    assert (five.staged_chunks, five.staged_chunk_numel) == (5, 1000)
    assert ring_shape(five, torch.float32, True) == (1000, 5)
    three = streamed_step_costs(torch.float32, True, chunk_numel=1000)
    assert ring_shape(three, torch.float32, True) == (1000, stream_costs.STREAM_SLOTS)
    unstaged = streamed_step_costs(torch.float32, True, chunk_numel=1000, stage_in_backward=False)
    assert ring_shape(unstaged, torch.float32, True) == (1000, stream_costs.STREAM_SLOTS)
    assert ring_shape(None, torch.float32, True) == (
        stream_costs.STREAM_CHUNK_NUMEL,
        stream_costs.STREAM_SLOTS,
    )
    # Under 3 GiB the ring keeps its tenth: more slots, smaller chunks.
    w2 = streamed_step_costs(torch.float32, True, budget_bytes=3 * gib)
    w2_six = streamed_step_costs(torch.float32, True, budget_bytes=3 * gib, slots=6)
    assert w2_six.slot_bytes <= 0.1 * 3 * gib
    assert w2_six.staged_chunks == 6
    assert w2_six.staged_chunk_numel < chunk_numel_for(w2.slot_bytes, torch.float32, True)
    # Under 40 GiB the chunk stays whole, and the ring grows by the slots added.
    w3 = streamed_step_costs(torch.float32, True, budget_bytes=40 * gib)
    w3_six = streamed_step_costs(torch.float32, True, budget_bytes=40 * gib, slots=6)
    assert w3_six.staged_chunk_numel == w3.staged_chunk_numel == STREAM_CHUNK_NUMEL
    assert w3_six.slot_bytes - w3.slot_bytes == 3 * STREAM_CHUNK_NUMEL * 16
    with pytest.raises(ValueError, match="needs stage_in_backward"):
        streamed_step_costs(torch.float32, True, slots=5, stage_in_backward=False)
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="must be an int >= 2"):
            streamed_step_costs(torch.float32, True, slots=bad)  # type: ignore[arg-type]


def test_a_ring_of_more_slots_stages_as_many_chunks_and_steps_the_same(
    streaming: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan whose ring has 5 slots: the optimizer builds its rings so, the backward's
    hook stages 5 chunks of state, and training is bit for bit the host-stepped run's."""
    import dataclasses

    shaped = test_speculate.offload_module  # the fixture's: host regions after the first streamed

    def planned(*args: Any, **kwargs: Any) -> Any:
        module = shaped(*args, **kwargs)
        costs = streamed_step_costs(torch.float32, False, chunk_numel=1000, slots=5)
        module.plan = dataclasses.replace(module.plan, streamed=costs)
        return module

    rings: list[tuple[int, int]] = []  # (slots, chunk) of each ring built
    init = StreamRing.__init__

    def recording(self: StreamRing, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        rings.append((len(self.slots), self.chunk))

    most_staged = [0]
    stage = StreamRing.stage

    def staging(self: StreamRing, *tensors: Any) -> bool:
        done = stage(self, *tensors)
        most_staged[0] = max(most_staged[0], self.staged())
        return done

    monkeypatch.setattr(test_speculate, "offload_module", planned)
    monkeypatch.setattr(StreamRing, "__init__", recording)
    monkeypatch.setattr(StreamRing, "stage", staging)
    kwargs: dict[str, Any] = {"stage_in_backward": True, "dtype": torch.bfloat16}
    out = run(False, 5, **kwargs)
    assert rings and all(shape == (5, 1000) for shape in rings)
    assert most_staged[0] == 5
    with pytest.MonkeyPatch.context() as mp:  # every region host-stepped
        mp.setattr(test_speculate, "offload_module", offload_module)
        plain = run(False, 5, **kwargs)
    assert_same(out, plain)


class _Gate:
    """Stands in for the CUDA event after a streamed region's downloads: it lands only
    when the test lets it (``opened``)."""

    def __init__(self, opened: threading.Event) -> None:
        self.opened = opened

    def query(self) -> bool:
        return self.opened.is_set()

    def synchronize(self) -> None:
        assert self.opened.wait(timeout=60.0), "waited for downloads never let land"


def _wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Whether ``condition`` holds within ``timeout_s``: a bound for something expected to
    happen, generous because a loaded machine (a first numba compilation, other test
    workers) can hold a thread for seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("name", ["fp16_overflow", "bf16_clip"])
def test_streamed_regions_landing_after_the_answer_do_not_hold_the_worker(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DEVICE_ANSWER with every host-state hook held until step() has the answer: the
    hook of a streamed region only issues its device step, and the region is published
    once its downloads land (here: when the test lets them), while the worker goes on
    with the next hooks. So the host-stepped region, whose gradients land after every
    streamed one's, steps and is published while no streamed download has landed. The
    run equals the same plan stepped synchronously, bit for bit."""
    opts = test_overlap.ANSWER_CASES[name]
    build = test_overlap.offload_module
    streamed_regions: list[int] = []

    def offload_streamed(*args: Any, **kwargs: Any) -> Any:
        module = build(*args, **kwargs)
        host = [st for st in module.storages if st.host_state]
        for st in host[1:]:
            st.streamed = True
        streamed_regions[:] = [st.index for st in host[1:]]
        return module

    gate = threading.Event()
    issue = StreamRing.issue

    def gated(
        self: StreamRing, pieces: list[StreamPiece], grad_scale: float | None, **kw: Any
    ) -> Any:
        issue(self, pieces, grad_scale, **kw)  # on the CPU its copies are done here
        return _Gate(gate)

    monkeypatch.setattr(test_overlap, "offload_module", offload_streamed)
    monkeypatch.setattr(StreamRing, "issue", gated)
    steps = 4
    gate.set()
    reference = test_overlap.Trainer(opts, overlap=False)
    expected = reference.train(range(steps))
    reference.close()

    trainer = test_overlap.Trainer(opts, overlap=True)
    assert len(streamed_regions) >= 2, "the mixed plan has host-state regions to stream"
    host_stepped = next(st.index for st in trainer.module.storages if st.host_state)
    controller = trainer.module.controller
    published: list[int] = []
    publish, publish_written = controller.publish, controller.publish_written

    def recording(r: int) -> None:
        publish(r)
        published.append(r)

    def recording_written(r: int, event: Any) -> None:  # resident regions written on device
        publish_written(r, event)
        published.append(r)

    controller.publish = recording  # type: ignore[method-assign]
    controller.publish_written = recording_written  # type: ignore[method-assign]
    issued: list[int] = []
    issue_region = HybridAdam.issue_region

    def counting(self: HybridAdam, r: int, *args: Any, **kwargs: Any) -> bool:
        stepped = issue_region(self, r, *args, **kwargs)
        issued.append(r)
        return stepped

    monkeypatch.setattr(HybridAdam, "issue_region", counting)
    armed: list[test_overlap.Blocker] = []

    def hold_from_first_region(r: int, grads: list[torch.Tensor]) -> None:
        if armed:  # holds every host-state hook of the last backward (see test_overlap)
            controller.submit_host(armed.pop())

    controller.add_device_grad_hook(hold_from_first_region)
    losses = []
    for step in range(steps):
        trainer.amp.zero_grad()
        gate.clear()
        published.clear()
        issued.clear()
        blocker = test_overlap.Blocker()
        losses.append(trainer.backward(step, before_last=functools.partial(armed.append, blocker)))
        trainer.amp.step()
        trainer.after_step()
        blocker.release.set()
        if step != opts.poison_step:
            assert _wait_until(lambda: host_stepped in published), "the worker was held"
            assert set(streamed_regions) <= set(issued), "every streamed hook returned"
            assert not set(published) & set(streamed_regions), "published before landing"
        gate.set()
        report = trainer.amp.last_step  # waits for the window's last task
        assert report is not None and report.overlap is OverlapMode.DEVICE_ANSWER
        assert not blocker.timed_out
        assert report.skipped == (step == opts.poison_step)
        if not report.skipped:
            assert sorted(t.region for t in report.region_steps if t.streamed) == sorted(
                streamed_regions
            )
            assert set(streamed_regions) <= set(published)
    assert losses == expected.losses
    stepped = masters(trainer.module)
    for key, value in expected.masters.items():
        assert torch.equal(stepped[key], value), key
    trainer.close()


class _SlotGate(_Gate):
    """A slot's "last download landed" event that the test lets land; counts queries."""

    def __init__(self, opened: threading.Event) -> None:
        super().__init__(opened)
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return super().query()

    def wait_on(self, stream: Any) -> None:
        """The device-side wait, which on the CPU has nothing to order (as ``Event``'s)."""


@pytest.mark.parametrize("paced", [True, False])
def test_a_paced_issue_takes_a_chunk_only_once_its_slot_is_free(paced: bool) -> None:
    """[Note: paced ring] in streamed/ring.py: paced (the issuing thread), the issue polls
    the slot's event (sleeping, not spinning on the GIL) and issues the chunk after it
    lands; unpaced (a hook's issue on the host worker), it issues at once."""
    ring = StreamRing(torch.device("cpu"), torch.float32, False, chunk_numel=4, slots=2)
    n = 8  # two chunks: one per slot
    master = torch.zeros(n)
    piece = StreamPiece(
        master,
        torch.zeros(n),
        torch.zeros(n),
        torch.ones(n),
        1.0,
        AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, True),
    )
    opened = threading.Event()
    gates = [_SlotGate(opened) for _ in ring.slots]
    for slot, gate in zip(ring.slots, gates, strict=True):
        slot.free = gate  # type: ignore[assignment]
    done = threading.Event()
    thread = threading.Thread(target=lambda: (ring.issue([piece], None, paced=paced), done.set()))
    thread.start()
    try:
        if paced:
            assert _wait_until(lambda: gates[0].queries >= 3), "it polls the slot"
            assert not done.is_set() and torch.equal(master, torch.zeros(n)), "nothing issued"
            opened.set()
        assert done.wait(timeout=10.0)
    finally:
        opened.set()
        thread.join(timeout=10.0)
    assert not torch.equal(master, torch.zeros(n)), "both chunks stepped"
    assert (gates[0].queries > 0) == paced and (gates[1].queries > 0) == paced
    assert (ring.paced_wait_s > 0) == paced, "the waits are counted"


def _ring_pieces(*sizes: int) -> list[StreamPiece]:
    """Pieces with distinct state and gradients, for ring tests on the CPU."""
    hyper = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0, True)
    g = torch.Generator().manual_seed(0)
    return [
        StreamPiece(
            torch.randn(n, generator=g),
            torch.randn(n, generator=g) * 0.1,
            torch.rand(n, generator=g) * 0.1,
            torch.randn(n, generator=g),
            3.0,
            hyper,
        )
        for n in sizes
    ]


@pytest.mark.parametrize("order", ["as_staged", "reversed"])
def test_a_ring_staged_without_gradients_copies_them_up_at_the_step(order: str) -> None:
    """[Note: staging the state in backward] in streamed/ring.py: master and moments staged
    before the gradient exists; the step copies up the gradient its piece has then, and
    the values are the unstaged ring's, bit for bit. Asked in another order, the ring
    drops them. Staging stops when the slots run out and once the ring has issued a
    chunk."""
    ring_of = functools.partial(StreamRing, torch.device("cpu"), torch.float32, False)
    plain, staged = _ring_pieces(10, 3), _ring_pieces(10, 3)
    ring_of(chunk_numel=4, slots=3).issue(plain, 2.0)
    ring = ring_of(chunk_numel=4, slots=3)
    first = staged[0]
    landed = first.grad.clone()
    first.grad.zero_()  # not made yet: the CPU ring copies at once, so a copy would show
    second = staged[1]
    assert ring.stage(first.master, first.exp_avg, first.exp_avg_sq)
    assert ring.staged() == 3, "10 elements in chunks of 4 take the three slots"
    assert not ring.stage(second.master, second.exp_avg, second.exp_avg_sq)
    assert ring.staged() == 3, "no slot is left for the second piece"
    first.grad.copy_(landed)
    ring.issue(staged if order == "as_staged" else staged[::-1], 2.0)
    assert ring.staged_used == (3 if order == "as_staged" else 0)
    assert ring.staged() == 0
    assert not ring.stage(first.master, first.exp_avg, first.exp_avg_sq)
    assert ring.staged() == 0, "an issued ring stages nothing"
    ring.close()
    for a, b in zip(plain, staged, strict=True):
        for x, y in ((a.master, b.master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
            assert torch.equal(x, y)


def test_a_ring_closed_with_chunks_staged_writes_nothing_back() -> None:
    """A skipped step closes a ring that only staged (``HybridAdam.drop_staged``): the
    host state is left as it was."""
    (piece,) = _ring_pieces(6)
    before = [t.clone() for t in (piece.master, piece.exp_avg, piece.exp_avg_sq)]
    ring = StreamRing(torch.device("cpu"), torch.float32, False, chunk_numel=4, slots=2)
    assert ring.stage(piece.master, piece.exp_avg, piece.exp_avg_sq)
    assert ring.staged() == 2
    ring.close()
    assert ring.staged() == 0 and ring.staged_used == 0
    for old, now in zip(before, (piece.master, piece.exp_avg, piece.exp_avg_sq), strict=True):
        assert torch.equal(old, now)


def _record_publishes(controller: OffloadController) -> list[tuple[int, str]]:
    """Wrap ``controller``'s publishes (both kinds: a resident streamed region may be
    written on the device) to record each as (region, the publishing thread's name)."""
    published: list[tuple[int, str]] = []
    publish, publish_written = controller.publish, controller.publish_written

    def recording(r: int) -> None:
        publish(r)
        published.append((r, threading.current_thread().name))

    def recording_written(r: int, event: Any) -> None:
        publish_written(r, event)
        published.append((r, threading.current_thread().name))

    controller.publish = recording  # type: ignore[method-assign]
    controller.publish_written = recording_written  # type: ignore[method-assign]
    return published


def _step_on_a_thread(amp: AMPOptimizer) -> tuple[threading.Thread, list[BaseException]]:
    """One backward, then ``amp.step()`` on a thread of its own (started; with inline host
    work it runs the host task there), and the list that collects what it raised."""
    amp.zero_grad()
    b = batch(0)
    amp.backward(loss_of(amp.module(**b), b["input_ids"]))
    errors: list[BaseException] = []

    def step() -> None:
        try:
            amp.step()
        except BaseException as exc:
            errors.append(exc)

    stepping = threading.Thread(target=step, name="stepping")
    stepping.start()
    return stepping, errors


def test_a_paced_wait_calls_between_until_the_slot_is_free() -> None:
    """While a paced issue waits for its slot it calls ``between()`` (the issuing thread
    publishing landed regions), before each sleep, and not once the slot is free."""
    opened = threading.Event()
    gate = _SlotGate(opened)
    calls: list[int] = []

    def between() -> None:
        calls.append(gate.queries)
        if len(calls) == 3:
            opened.set()

    streamed_module.wait_polling(gate, poll_s=1e-4, between=between)  # type: ignore[arg-type]
    assert calls == [1, 2, 3], "once after each query that found the slot busy"
    assert gate.queries == 4


def test_landed_regions_are_published_while_the_issuing_thread_still_issues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: publishing while issuing] in streamed/queue.py: step()'s task, its host steps
    done, publishes a streamed region once it lands even while the issuing thread is
    still busy with a later one, instead of waiting for the issuing thread first. Here
    the first streamed region's downloads land only after every host-stepped region is
    published, and the issuing thread is held before the second streamed region until the
    test has seen the first one published (or given up)."""
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16, host_worker=False)
    host = [st for st in module.storages if st.host_state]
    assert len(host) >= 3, "the mixed plan has three host-state regions"
    first, second = host[1].index, host[2].index
    host[1].streamed = host[2].streamed = True
    host_stepped = {st.index for st in host if not st.streamed}
    landed, release = threading.Event(), threading.Event()
    issue_streamed = StreamedSteps.issue_streamed

    def gated(self: StreamedSteps, ring: StreamRing, r: int, *args: Any) -> Any:
        if r == second:
            assert release.wait(timeout=60.0), "the test never let the issuing go on"
        _, written = issue_streamed(self, ring, r, *args)  # on the CPU: done here
        return (_Gate(landed) if r == first else None), written

    monkeypatch.setattr(StreamedSteps, "issue_streamed", gated)
    records = _record_publishes(module.controller)

    def published() -> list[int]:
        return [r for r, _ in records]

    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
    stepping, errors = _step_on_a_thread(amp)
    try:
        assert _wait_until(lambda: host_stepped <= set(published())), "host steps ran"
        assert first not in published(), "published before its downloads landed"
        landed.set()
        published_while_issuing = _wait_until(lambda: first in published(), timeout_s=5.0)
        assert second not in published()
    finally:
        landed.set()
        release.set()
        stepping.join(timeout=60.0)
    module.close()
    assert not errors and not stepping.is_alive()
    assert published_while_issuing, "the landed region waited for the issuing thread"
    assert published().index(first) < published().index(second)


@pytest.mark.skipif(
    not single_pass.fp16_io_available(), reason="numba or the CPU's fp16 conversions missing"
)
@pytest.mark.parametrize("fp16_io", [True, False], ids=["issuer", "casting"])
def test_the_issuing_thread_publishes_a_region_that_lands_during_a_host_step(
    fp16_io: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[Note: the issuing thread publishes] in streamed/queue.py: an offloaded streamed
    region that lands while the host worker is inside a host step is published by the
    issuing thread then, not after that step. Without fp16 I/O its publish casts the new
    master on the host, and the host worker publishes it once the step ends. Here the
    first host-state region's host step is held until the test has seen the streamed one
    published (or given up); on the CPU its downloads land as it is issued."""
    # Without overlap every host-state region steps in step()'s task.
    io = {"host_kernel": "single_pass", "fp16_io": True} if fp16_io else {}
    options = PlanOptions(overlap=False, **io)
    module = offload_module(
        tiny_gpt2(), batch(0), dtype=torch.float16, host_worker=False, options=options
    )
    host = [st for st in module.storages if st.host_state]
    assert len(host) >= 2 and host[1].offloaded, "the mixed plan offloads region 1"
    held, streamed_r = host[0].index, host[1].index
    host[1].streamed = True
    entered, release = threading.Event(), threading.Event()
    step_segments = Stepper.step_segments

    def holding(self: Stepper, r: int, *args: Any, **kwargs: Any) -> Any:
        if r == held:
            entered.set()
            assert release.wait(timeout=60.0), "the test never let the host step go on"
        return step_segments(self, r, *args, **kwargs)

    monkeypatch.setattr(Stepper, "step_segments", holding)
    published = _record_publishes(module.controller)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
    stepping, errors = _step_on_a_thread(amp)
    by_issuer = fp16_io
    try:
        assert entered.wait(timeout=60.0), "the held host step began"
        during = _wait_until(
            lambda: streamed_r in {r for r, _ in published},
            timeout_s=5.0 if by_issuer else 0.5,
        )
        assert held not in {r for r, _ in published}
    finally:
        release.set()
        stepping.join(timeout=60.0)
    module.close()
    assert not errors and not stepping.is_alive()
    by = dict(published)
    assert during == by_issuer, "published during the host step only by the issuer"
    assert by[streamed_r].startswith("offload-stream-issue") == by_issuer
    assert held in by, "the held region was published after its step"


@pytest.mark.skipif(
    not single_pass.fp16_io_available(), reason="numba or the CPU's fp16 conversions missing"
)
def test_publishing_from_the_issuing_thread_changes_no_value(
    streaming: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp16 I/O, where the issuing thread publishes the streamed regions: the run equals
    the one where every publish is taken to cast on the host, so that the host worker
    publishes them, bit for bit, overflow skip included."""
    common: dict[str, Any] = {
        "host_kernel": "single_pass",
        "fp16_io": True,
        "growth_interval": 3,
        "initial_scale": 2.0**8,
    }
    out = run(False, 5, poison=(2,), **common)
    assert streaming["pieces"] > 0
    monkeypatch.setattr(OffloadController, "publish_casts", lambda self, r: True)
    plain = run(False, 5, poison=(2,), **common)
    assert_same(out, plain)
    assert out.skipped[2] and not any(out.skipped[3:])


def test_the_issuing_threads_publishing_stops_at_an_entry_that_casts() -> None:
    """``casting=False`` (the issuing thread) publishes landed entries up to the first
    whose publish casts on the host, and :meth:`publish_until_empty` returns there,
    leaving it and what follows to the host worker's ``publish_landed``."""
    published: list[int] = []
    queue = streamed_module.StreamedQueue()
    for r, casts in enumerate([False, True, False]):
        queue.add(r, None, 0.0, lambda s, e, r=r: published.append(r), casts=casts)
    queue.publish_until_empty(poll_s=1e-4)
    assert published == [0] and queue.regions() == [1, 2]
    queue.publish_landed(casting=False)
    assert published == [0]
    queue.publish_landed()
    assert published == [0, 1, 2] and queue.regions() == []


def test_the_queue_publishes_in_issue_order_once_landed() -> None:
    """Entries publish in the order issued, each with its own callback, and not past the
    first whose downloads have not landed; ``wait`` publishes the rest."""
    gates = [threading.Event() for _ in range(3)]
    published: list[tuple[int, float, float]] = []
    queue = streamed_module.StreamedQueue()
    for r, gate in enumerate(gates):
        queue.add(
            r,
            _Gate(gate),  # type: ignore[arg-type]
            float(r),
            functools.partial(lambda r, start, end: published.append((r, start, end)), r),
        )
    gates[1].set()
    queue.publish_landed()
    assert published == [] and queue.regions() == [0, 1, 2], "region 0 has not landed"
    gates[0].set()
    queue.publish_landed()
    assert [p[0] for p in published] == [0, 1] and queue.regions() == [2]
    assert [p[1] for p in published] == [0.0, 1.0], "each with its own issue time"
    threading.Timer(0.05, gates[2].set).start()
    queue.publish_landed(wait=True)
    assert [p[0] for p in published] == [0, 1, 2] and queue.regions() == []


def test_an_error_on_the_issuing_thread_reaches_the_training_loop(
    streaming: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without overlap every host-state region steps in step()'s task (no hook issues a
    # streamed region first, whatever the timing), and step() waits for it. The second
    # issue fails on the issuing thread: the task waits for the thread, fails every
    # region it had announced (so nothing waits forever), drops the ring, and step()
    # raises the error. Nothing is issued after the failure.
    issue = StreamRing.issue  # the fixture's counting wrapper
    calls = {"n": 0}

    def failing(
        self: StreamRing, pieces: list[StreamPiece], grad_scale: float | None, **kw: Any
    ) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("issue failed on purpose")
        return issue(self, pieces, grad_scale, **kw)

    monkeypatch.setattr(StreamRing, "issue", failing)
    trainer = test_speculate.Trainer(False, overlap=False)
    try:
        trainer.amp.zero_grad()
        trainer.backward(0)
        with pytest.raises(RuntimeError, match="issue failed on purpose"):
            trainer.amp.step()
        assert calls["n"] == 2
        assert "offload-stream-issue" in {n.split("_")[0] for n in streaming["threads"]}
        hy = trainer.amp.optimizer
        assert isinstance(hy, HybridAdam)
        assert hy._streamed.open is None and hy._streamed.issuing == 0  # the ring was let go
    finally:
        with contextlib.suppress(RuntimeError):
            trainer.close()


def test_the_queue_publishes_in_issue_order_while_another_thread_adds() -> None:
    # The issuing thread adds while the host worker publishes and reads the regions left:
    # every entry is published once, in order, and reading the queue never trips over an
    # append (without the queue's lock, reading a long deque while another thread appends
    # raises "deque mutated during iteration"; three rounds with threads switching as
    # often as the interpreter can catch that nearly always).
    from offload_optim.streamed import StreamedQueue

    n = 100000
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            queue = StreamedQueue()
            published: list[int] = []

            def adder(queue: StreamedQueue = queue, published: list[int] = published) -> None:
                for r in range(n):
                    queue.add(r, None, 0.0, lambda s, e, r=r: published.append(r))

            thread = threading.Thread(target=adder)
            thread.start()
            rounds = 0
            while thread.is_alive():
                left = queue.regions()  # a long queue, read while it grows
                start = left[0] if left else 0
                assert left == list(range(start, start + len(left)))
                rounds += 1
                if rounds % 64 == 0:  # mostly read: the queue grows long
                    queue.publish_landed()
                    assert published == list(range(len(published)))
            thread.join()
            queue.publish_landed(wait=True)
            assert published == list(range(n))
    finally:
        sys.setswitchinterval(interval)


# --------------------------------------------------------------------------------------
# [Note: writing resident parameters] in streamed/steps.py
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("write", [True, False], ids=["written", "uploaded"])
def test_resident_streamed_regions_are_written_on_the_device(
    write: bool, streaming: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default a resident streamed region's device step writes its parameters in place
    and the region is published without an upload (``publish_written``); with
    ``WRITE_RESIDENT`` off (a plan whose costs say so) it is uploaded after its downloads.
    Offloaded ones always are. Both runs equal the host-stepped one bit for
    bit, overflow skip included."""
    monkeypatch.setattr(stream_costs, "WRITE_RESIDENT", write)
    how: dict[int, set[str]] = {}
    publish, publish_written = OffloadController.publish, OffloadController.publish_written

    def recording(self: OffloadController, r: int) -> None:
        how.setdefault(r, set()).add("publish")
        publish(self, r)

    def recording_written(self: OffloadController, r: int, event: Any) -> None:
        how.setdefault(r, set()).add("written")
        publish_written(self, r, event)

    monkeypatch.setattr(OffloadController, "publish", recording)
    monkeypatch.setattr(OffloadController, "publish_written", recording_written)
    growth: dict[str, Any] = {"growth_interval": 3, "initial_scale": 2.0**8}
    out = run(False, 4, poison=(2,), **growth)
    module = test_speculate.offload_module(tiny_gpt2(), batch(0), dtype=torch.float16)
    resident = {st.index for st in module.storages if not st.offloaded}
    module.close()
    streamed_resident = set(streaming["streamed"]) & resident
    assert streamed_resident, "the mixed plan streams a resident region"
    for r in streaming["streamed"]:
        written = write and r in streamed_resident
        assert how[r] == ({"written"} if written else {"publish"}), r
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_speculate, "offload_module", offload_module)
        plain = run(False, 4, poison=(2,), **growth)
    assert_same(out, plain)
    assert out.skipped[2]


def test_a_written_regions_next_forward_does_not_wait_for_its_downloads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The next forward reads a written region's parameters once the device step wrote
    them (the compute stream waits for ``ready_early``'s event), not once its downloads
    landed and it was published: here they land only after that forward has run."""
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16, host_worker=True)
    host = [st for st in module.storages if st.host_state]
    target = next(st for st in host[1:] if not st.offloaded)
    target.streamed = True
    r = target.index
    landed = threading.Event()
    issue_streamed = StreamedSteps.issue_streamed

    def gated(self: StreamedSteps, ring: StreamRing, q: int, *args: Any) -> Any:
        got, written = issue_streamed(self, ring, q, *args)  # on the CPU: done here
        return (_Gate(landed) if q == r else got), written

    monkeypatch.setattr(StreamedSteps, "issue_streamed", gated)
    controller = module.controller
    published: list[int] = []
    publish_written = controller.publish_written

    def recording_written(q: int, event: Any) -> None:
        publish_written(q, event)
        published.append(q)

    controller.publish_written = recording_written  # type: ignore[method-assign]
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
    forwarded = threading.Event()
    errors: list[BaseException] = []

    def forward() -> None:
        try:
            b = batch(1)
            with torch.no_grad():
                loss_of(module(**b), b["input_ids"])
            forwarded.set()
        except BaseException as exc:
            errors.append(exc)

    try:
        amp.zero_grad()
        b = batch(0)
        amp.backward(loss_of(module(**b), b["input_ids"]))
        before = target.device_params.clone()
        amp.step()
        assert _wait_until(lambda: r in controller._early), "the region was issued"
        running = threading.Thread(target=forward)
        running.start()
        assert forwarded.wait(timeout=60.0), "the forward waited for the downloads"
        assert not errors
        assert r not in published, "published before its downloads landed"
        # What the forward read: the stepped master, narrowed on the device.
        assert not torch.equal(target.device_params, before)
        assert torch.equal(target.device_params, target.master.half())
        landed.set()
        controller.wait_host()
        running.join(timeout=60.0)
        assert published == [r]
    finally:
        landed.set()
        module.close()
