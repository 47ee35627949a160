"""fp16 host steps that speculate under backward and are undone exactly on overflow.

A speculative plan (``PlanOptions.speculative``) steps each host-state region in its
grad-ready hook (OverlapMode.SPECULATIVE_UNDO) before the overflow answer exists, and commits or
undoes those steps in ``step()``. Whatever happens, the run must be the default (PARTIALS)
run bit for bit: losses, masters, moments, step counts and loss scales. Modules use the
mixed plan of optim_helpers (every region kind); region 0, host-state and holding the
tied embedding, is the one whose gradients arrive last in backward.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from dataclasses import dataclass, field
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

import offload_optim.hybrid_adam as hybrid_adam_module
import offload_runtime.host_kernels.torch_adam as kernels
from offload_optim import AMPOptimizer, HybridAdam, OverlapMode
from offload_runtime import OffloadConfig
from offload_runtime.host_kernels import AdamHyper, fused_adam_, single_pass, speculative_adam_
from offload_solver import PlanOptions

LR = 1e-2
WD = 0.01


@dataclass
class Run:
    """Everything a training run produced, step by step and at the end."""

    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    step_counts: list[int] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    undone: list[int] = field(default_factory=list)
    modes: set[OverlapMode] = field(default_factory=set)
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    state: list[torch.Tensor] = field(default_factory=list)


class Trainer:
    """An fp16 OffloadModule (mixed plan), its AMPOptimizer, and an overflow injector."""

    def __init__(
        self,
        speculate: bool,
        *,
        host_worker: bool = True,
        micro: int = 1,
        moments: torch.dtype = torch.float32,
        clipping: float = 0.0,
        dtype: torch.dtype = torch.float16,
        convert_on_device: bool = False,
        host_kernel: str = "torch",
        fp16_io: bool = False,
        speculation_thread: bool = False,
        stage_in_backward: bool = False,
        **amp_kwargs: Any,
    ) -> None:
        self.micro = micro
        options = PlanOptions(
            host_kernel=host_kernel,
            fp16_io=fp16_io,
            speculative=speculate,
            speculative_params=amp_kwargs.pop("speculative_params", None),
            speculation_thread=speculation_thread,
            stage_in_backward=stage_in_backward,
            overlap=amp_kwargs.pop("overlap", True),
        )
        self.module = offload_module(
            tiny_gpt2(),
            batch(0),
            dtype=dtype,
            host_worker=host_worker,
            convert_on_device=convert_on_device,
            options=options,
            config=OffloadConfig(
                dtype=dtype,
                host_state="fp32" if moments == torch.float32 else "bf16_moments",
                accumulation_steps=micro,
            ),
        )
        assert self.module.storages[0].host_state, "the plan keeps region 0's state on the host"
        self.poison_steps: set[int] = set()
        self.poison_region = 0
        self._step = -1
        overflow_on_device(
            self.module, lambda r: self._step in self.poison_steps and r == self.poison_region
        )
        self.amp = AMPOptimizer(
            HybridAdam(self.module.parameters(), lr=LR, weight_decay=WD),
            self.module,
            clipping_norm=clipping,
            **amp_kwargs,
        )

    def backward(self, step: int) -> float:
        self._step = step
        total = 0.0
        for k in range(self.micro):
            b = batch(step * self.micro + k)
            loss = loss_of(self.module(**b), b["input_ids"]) / self.micro
            self.amp.backward(loss)
            total += loss.item()
        return total

    def train(self, steps: range, out: Run | None = None) -> Run:
        out = Run() if out is None else out
        for step in steps:
            self.amp.zero_grad()
            out.losses.append(self.backward(step))
            self.amp.step()
            report = self.amp.last_step
            assert report is not None
            out.scales.append(report.loss_scale)
            out.step_counts.append(self.amp.step_count)
            out.skipped.append(report.skipped)
            out.undone.append(report.undone_regions)
            out.modes.add(report.overlap)
        out.masters = masters(self.module)
        out.state = committed_state(self.amp)
        return out

    def close(self) -> None:
        self.module.close()


def committed_state(amp: AMPOptimizer) -> list[torch.Tensor]:
    """Moments and step counts, read through ``state`` (after the host steps)."""
    amp.synchronize()
    return [t.clone() for st in amp.state.values() for t in st.values()]


Snapshot = tuple[dict[str, torch.Tensor], list[torch.Tensor]]


def snapshot(trainer: Trainer) -> Snapshot:
    """Master weights and committed optimizer state, copied."""
    return masters(trainer.module), committed_state(trainer.amp)


def assert_unchanged(trainer: Trainer, before: Snapshot) -> None:
    """Masters, moments and step counts are bit-identical to ``before``."""
    after_w, after_s = snapshot(trainer)
    for name, value in before[0].items():
        assert torch.equal(after_w[name], value), name
    assert all(torch.equal(a, b) for a, b in zip(after_s, before[1], strict=True))


def assert_same(a: Run, b: Run) -> None:
    assert a.losses == b.losses
    assert a.scales == b.scales
    assert a.step_counts == b.step_counts
    assert a.skipped == b.skipped
    assert a.masters.keys() == b.masters.keys()
    for name, value in a.masters.items():
        assert torch.equal(value, b.masters[name]), name
    assert len(a.state) == len(b.state)
    assert all(torch.equal(x, y) for x, y in zip(a.state, b.state, strict=True))


def run(speculate: bool, steps: int, *, poison: tuple[int, ...] = (), **kwargs: Any) -> Run:
    trainer = Trainer(speculate, **kwargs)
    trainer.poison_steps = set(poison)
    try:
        return trainer.train(range(steps))
    finally:
        trainer.close()


def host_state_regions(amp: AMPOptimizer) -> list[int]:
    return [st.index for st in amp.module.storages if st.host_state]


# ---- the kernel --------------------------------------------------------------------------


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_speculative_kernel_equals_the_fused_step_and_keeps_the_old_state(
    monkeypatch: pytest.MonkeyPatch, moments: torch.dtype
) -> None:
    """Chunked (several chunks and a ragged tail): the fused step's bits, the old master in
    the backup, the old moments untouched, the new ones in the spare buffers."""
    monkeypatch.setattr(kernels, "SPECULATE_CHUNK_NUMEL", 256)
    n = 256 * 5 + 77
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 512
    m = (torch.randn(n, generator=gen) * 0.1).to(moments)
    v = (torch.rand(n, generator=gen) * 0.01).to(moments)
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    scale = torch.tensor(512.0)
    step = torch.tensor(4.0)

    ref = [t.clone() for t in (p, g, m, v)]
    fused_adam_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [step], hyper, scale)

    old = [t.clone() for t in (p, g, m, v)]
    m_next, v_next, backup = torch.empty_like(m), torch.empty_like(v), torch.empty_like(p)
    partial = speculative_adam_(p, g, m, v, m_next, v_next, backup, step, hyper, scale)
    assert torch.equal(p, ref[0]) and torch.equal(g, ref[1])
    assert torch.equal(m_next, ref[2]) and torch.equal(v_next, ref[3])
    assert torch.equal(backup, old[0])
    assert torch.equal(m, old[2]) and torch.equal(v, old[3])
    # Summed chunk by chunk: equal to the plain sum up to fp32 rounding of the order.
    assert abs(float(partial) - float(old[1].sum())) <= 1e-5 * float(old[1].abs().sum())

    g_bad = old[1].clone()
    g_bad[n - 3] = math.nan
    partial = speculative_adam_(
        old[0].clone(), g_bad, m, v, m_next, v_next, backup, step, hyper, scale
    )
    assert not math.isfinite(float(partial)), "a nan anywhere makes the partial non-finite"


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("adamw", [False, True])
def test_single_pass_kernels_agree_with_each_other_and_with_torch(
    adamw: bool, scaled: bool, moments: torch.dtype
) -> None:
    """Two parallel blocks and a ragged tail. In place and speculative: the same bits, the
    old master in the backup, the old moments untouched, the unscaled gradient written back
    as torch's kernel writes it. Against torch's fused kernel: equal up to rounding."""
    from offload_runtime.host_kernels._numba_adam import BLOCK  # imports numba

    n = 2 * BLOCK + 77
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * (512 if scaled else 1)
    m = (torch.randn(n, generator=gen) * 0.1).to(moments)
    v = (torch.rand(n, generator=gen) * 0.01).to(moments)
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=adamw)
    scale = torch.tensor(512.0) if scaled else None
    step = torch.tensor(4.0)
    old = [t.clone() for t in (p, g, m, v)]

    ref = [t.clone() for t in old]
    fused_adam_([ref[0]], [ref[1]], [ref[2]], [ref[3]], [step], hyper, scale)
    plain = [t.clone() for t in old]
    single_pass.adam_(plain[0], plain[1], plain[2], plain[3], step, hyper, scale)
    update = (ref[0] - old[0]).abs().max()
    assert float((plain[0] - ref[0]).abs().max()) <= 1e-5 * float(update)
    # Rounding differences only (FMA contraction, operation order): relative to the
    # largest moment, since elements near zero lose their relative precision to cancellation.
    # bf16 moments: the fp32 values round to the same bf16 but where they straddle a
    # rounding boundary (then one bf16 step apart: 2**-7 relative at most).
    for mine, theirs in ((plain[2].float(), ref[2].float()), (plain[3].float(), ref[3].float())):
        slack = 1e-6 * theirs.abs().max()
        if moments == torch.bfloat16:
            slack = torch.maximum(theirs.abs() * 2**-7, slack)
        assert bool(((mine - theirs).abs() <= slack).all())
    assert torch.equal(plain[1], ref[1]), "the gradient is left as torch's kernel leaves it"

    m_next, v_next = torch.empty(n, dtype=moments), torch.empty(n, dtype=moments)
    backup = torch.empty(n)
    partial = single_pass.speculative_adam_(p, g, m, v, m_next, v_next, backup, step, hyper, scale)
    assert torch.equal(p, plain[0]) and torch.equal(g, plain[1])
    assert torch.equal(m_next, plain[2]) and torch.equal(v_next, plain[3])
    assert torch.equal(backup, old[0])
    assert torch.equal(m, old[2]) and torch.equal(v, old[3])
    assert float(partial) == 0.0

    for bad in (math.inf, -math.inf, math.nan):
        g_bad = old[1].clone()
        g_bad[n - 3] = bad  # in the ragged tail's block
        partial = single_pass.speculative_adam_(
            old[0].clone(), g_bad, m, v, m_next, v_next, backup, step, hyper, scale
        )
        assert not math.isfinite(float(partial)), bad


def test_single_pass_refuses_what_it_cannot_step(monkeypatch: pytest.MonkeyPatch) -> None:
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    x = torch.zeros(8)
    with pytest.raises(ValueError, match=r"torch\.float32 here; grad is torch\.bfloat16"):
        single_pass.adam_(x, x.bfloat16(), x.clone(), x.clone(), torch.tensor(1.0), hyper)
    with pytest.raises(ValueError, match=r"moments in float32 or bfloat16, not torch\.float16"):
        single_pass.adam_(x, x.clone(), x.half(), x.half(), torch.tensor(1.0), hyper)
    with pytest.raises(ValueError, match="exp_avg has 4 elements, not 8"):
        single_pass.adam_(x, x.clone(), x[:4].clone(), x.clone(), torch.tensor(1.0), hyper)
    with pytest.raises(ValueError, match="host_kernel is 'cuda'"):
        PlanOptions(host_kernel="cuda")
    # A plan that steps with the single-pass kernels, bound where numba cannot load.
    module = offload_module(
        tiny_gpt2(), batch(0), host_worker=False, options=PlanOptions(host_kernel="single_pass")
    )
    monkeypatch.setattr(single_pass, "available", lambda: False)
    with pytest.raises(ImportError, match="pip install numba"):
        HybridAdam(module.parameters()).bind(module)
    module.close()


# ---- training ------------------------------------------------------------------------------

EXACT_CASES: dict[str, dict[str, Any]] = {
    "fp32_moments": {},
    "bf16_moments": {"moments": torch.bfloat16},
    "accumulate_2": {"micro": 2},
    "convert_on_device": {"convert_on_device": True},
    # Both runs step with the single-pass kernels: the speculative one in the same pass as
    # its undo data, the plain one in place.
    "single_pass": {"host_kernel": "single_pass"},
    "single_pass_bf16_moments": {"host_kernel": "single_pass", "moments": torch.bfloat16},
    # Speculative steps on a thread of their own, committed by step()'s host task.
    "speculation_thread": {"speculation_thread": True},
    "speculation_thread_accumulate_2": {"speculation_thread": True, "micro": 2},
}


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_speculative_fp16_training_is_bit_identical(name: str) -> None:
    """A dozen steps on the host worker thread, the scale growing on the way: every loss,
    master, moment and step count equals the non-speculative run's."""
    kwargs: dict[str, Any] = dict(EXACT_CASES[name])
    steps = 12
    growth: dict[str, Any] = {"growth_interval": 3, "initial_scale": 2.0**8}
    spec = run(True, steps, **kwargs, **growth)
    plain = run(False, steps, **kwargs, **growth)
    assert_same(spec, plain)
    # The first window answers first and steps nothing early ([Note: clipping on demand]).
    assert spec.modes == {OverlapMode.DEVICE_ANSWER, OverlapMode.SPECULATIVE_UNDO}
    # fp16 without clipping: the answer from the device, accumulating or not.
    assert plain.modes == {OverlapMode.DEVICE_ANSWER}
    assert spec.scales[-1] > spec.scales[0], "the scale grew: steps were committed"
    assert spec.undone == [0] * steps and not any(spec.skipped)
    assert sum(spec.losses[-3:]) < sum(spec.losses[:3]), "the run trains"


@pytest.mark.parametrize(
    ("host_kernel", "speculation_thread"),
    [("torch", False), ("single_pass", False), ("torch", True)],
)
@pytest.mark.parametrize("host_worker", [False, True])
def test_overflow_in_the_last_region_undoes_the_speculative_steps(
    host_worker: bool, host_kernel: str, speculation_thread: bool
) -> None:
    """An inf in region 0, whose gradients arrive last: the other host-state regions have
    stepped already (inline hooks: all of them). The step is skipped, the scale halves
    (hysteresis 1), masters, moments and step counts are as before the step, and the rest
    of the run equals the non-speculative one bit for bit."""
    trainer = Trainer(
        True,
        host_worker=host_worker,
        hysteresis=1,
        host_kernel=host_kernel,
        speculation_thread=speculation_thread,
    )
    head = trainer.train(range(3))
    before = snapshot(trainer)
    scale = trainer.amp.loss_scale
    trainer.poison_steps = {3}
    trainer.train(range(3, 4), head)
    report = trainer.amp.last_step
    assert report is not None and report.skipped
    assert report.overlap is OverlapMode.SPECULATIVE_UNDO
    assert trainer.amp.loss_scale == scale / 2
    assert trainer.amp.step_count == 3
    assert trainer.amp.undone_steps == 1
    host = host_state_regions(trainer.amp)
    if not host_worker and not speculation_thread:
        # Inline hooks all run during backward: every host-state region stepped, region 0
        # (poisoned) last, and every one of them was undone.
        assert report.undone_regions == report.speculated_regions == len(host)
        order = [t.region for t in report.region_steps if t.host]
        assert order == sorted(host, reverse=True)
    else:
        assert 0 <= report.undone_regions == report.speculated_regions <= len(host)
    assert_unchanged(trainer, before)
    spec = trainer.train(range(4, 8), head)
    trainer.close()
    plain = run(
        False,
        8,
        poison=(3,),
        host_worker=host_worker,
        hysteresis=1,
        host_kernel=host_kernel,
        speculation_thread=speculation_thread,
    )
    assert_same(spec, plain)
    assert spec.skipped == [False] * 3 + [True] + [False] * 4


@pytest.mark.parametrize("poison", [False, True])
def test_a_speculative_step_in_flight_does_not_hold_step(poison: bool) -> None:
    """With speculation_thread, step() takes its answer and queues its host task while a
    speculative step still runs: the step is committed by that task (no overflow) or
    undone once it ends (overflow, step() waits for it). Either way the run is the
    non-speculative one bit for bit."""
    trainer = Trainer(True, hysteresis=1, speculation_thread=True)
    head = trainer.train(range(2))
    optimizer = trainer.amp.optimizer
    real = optimizer._speculation.speculate
    gate = threading.Event()
    held: list[int] = []

    def held_speculation(r: int, *args: Any) -> torch.Tensor:
        part = real(r, *args)
        if not held:
            held.append(r)
            assert gate.wait(30.0), "the test never released the speculative step"
        return part

    optimizer._speculation.speculate = held_speculation  # type: ignore[method-assign]
    if poison:
        trainer.poison_steps = {2}
    trainer.amp.zero_grad()
    head.losses.append(trainer.backward(2))
    deadline = time.monotonic() + 30.0
    while not held:  # the first speculative step of the backward is running
        assert time.monotonic() < deadline, "nothing speculated"
        time.sleep(0.001)
    timer = threading.Timer(0.3, gate.set)
    if poison:
        timer.start()  # step() waits for the step to undo it
    trainer.amp.step()
    if not poison:
        assert not gate.is_set() and set(held) <= optimizer.speculated_regions, (
            "step() returned while the speculative step ran, uncommitted"
        )
        gate.set()
    if poison:
        timer.join()
    report = trainer.amp.last_step
    assert report is not None and report.overlap is OverlapMode.SPECULATIVE_UNDO
    assert not optimizer.speculated_regions
    if poison:
        assert report.skipped and report.undone_regions >= 1
    else:
        assert not report.skipped and report.speculated_regions >= 1
    # What Trainer.train records for a step.
    head.scales.append(report.loss_scale)
    head.step_counts.append(trainer.amp.step_count)
    head.skipped.append(report.skipped)
    head.undone.append(report.undone_regions)
    optimizer._speculation.speculate = real  # type: ignore[method-assign]
    trainer.poison_steps = set()
    spec = trainer.train(range(3, 6), head)
    trainer.close()
    assert_same(spec, run(False, 6, poison=(2,) if poison else (), hysteresis=1))


def test_zero_grad_waits_for_a_speculative_step_on_its_thread_and_undoes_it() -> None:
    trainer = Trainer(True, speculation_thread=True)
    head = trainer.train(range(2))
    before = snapshot(trainer)
    trainer.backward(2)
    trainer.amp.zero_grad()  # drops the window: waits for the thread, then undoes
    assert not trainer.amp.optimizer.speculated_regions
    assert_unchanged(trainer, before)
    spec = trainer.train(range(2, 5), head)
    trainer.close()
    assert_same(spec, run(False, 5))


def test_hysteresis_two_skips_first_and_backs_off_on_the_second_overflow() -> None:
    spec = run(True, 6, poison=(2, 3), host_worker=False)
    plain = run(False, 6, poison=(2, 3), host_worker=False)
    assert_same(spec, plain)
    assert spec.skipped == [False, False, True, True, False, False]
    assert spec.scales[3] == spec.scales[2], "the first overflow only skips"
    assert spec.scales[4] == spec.scales[3] / 2, "the second one backs off"
    assert spec.undone[2] > 0 and spec.undone[3] > 0


def test_speculation_runs_under_backward() -> None:
    """Inline hooks: every host-state region stepped before backward returned, in its hook;
    the report says SPECULATIVE_UNDO and host step time falls before backward's end (the
    publishes after the commit are the rest)."""
    trainer = Trainer(True, host_worker=False)
    trainer.train(range(2))
    report = trainer.amp.last_step
    assert report is not None and report.overlap is OverlapMode.SPECULATIVE_UNDO
    assert report.backward_end_s is not None
    host = host_state_regions(trainer.amp)
    early = {t.region for t in report.region_steps if t.host and t.end_s <= report.backward_end_s}
    assert early == set(host)
    assert report.speculated_regions == len(host) and report.undone_regions == 0
    # How much of the host time came before backward's end is timing (publishes after the
    # commit are the rest, and a loaded machine stretches either): only that some did.
    assert report.hidden_fraction() > 0.0
    trainer.close()


def test_clipping_takes_the_device_answer_and_bf16_keeps_speculative() -> None:
    """Speculation with undo is for the fp16 overflow answer alone."""
    cases: list[tuple[dict[str, Any], OverlapMode]] = [
        ({"clipping": 0.5}, OverlapMode.DEVICE_ANSWER),
        ({"clipping": 0.5, "micro": 2}, OverlapMode.PARTIALS),
        ({"dtype": torch.bfloat16}, OverlapMode.SPECULATIVE),
        ({"dtype": torch.float32}, OverlapMode.SPECULATIVE),
    ]
    for kwargs, want in cases:
        trainer = Trainer(True, host_worker=False, **kwargs)
        trainer.train(range(2))  # a first step's backward never steps bf16/fp32 early
        report = trainer.amp.last_step
        assert report is not None and report.overlap is want, kwargs
        assert trainer.amp.optimizer.speculation_bytes() > 0, "no spare buffers allocated"
        trainer.close()


def test_clipping_with_speculate_equals_without() -> None:
    spec = run(True, 4, clipping=0.5, poison=(2,), hysteresis=1)
    plain = run(False, 4, clipping=0.5, poison=(2,), hysteresis=1)
    assert_same(spec, plain)
    assert spec.modes == {OverlapMode.DEVICE_ANSWER}


# ---- windows that end otherwise, checkpoints, memory ---------------------------------------


def test_zero_grad_before_step_undoes_and_training_continues_exactly() -> None:
    trainer = Trainer(True, host_worker=False)
    head = trainer.train(range(2))
    before = snapshot(trainer)
    trainer.backward(2)
    assert trainer.amp.optimizer.speculated_regions, "the hooks stepped speculatively"
    trainer.amp.zero_grad()  # drops the window: the speculative steps are undone
    assert not trainer.amp.optimizer.speculated_regions
    assert_unchanged(trainer, before)
    spec = trainer.train(range(2, 5), head)
    trainer.close()
    assert_same(spec, run(False, 5, host_worker=False))


def test_lr_change_between_backward_and_step_undoes_and_raises() -> None:
    trainer = Trainer(True, host_worker=False)
    trainer.train(range(1))
    before_w = masters(trainer.module)
    trainer.amp.zero_grad()
    trainer.backward(1)
    trainer.amp.param_groups[0]["lr"] = LR / 2
    with pytest.raises(RuntimeError, match="not taken"):
        trainer.amp.step()
    after_w = masters(trainer.module)
    assert all(torch.equal(after_w[n], v) for n, v in before_w.items())
    assert trainer.amp.step_count == 1
    trainer.amp.param_groups[0]["lr"] = LR
    trainer.train(range(1, 2))  # the window was dropped: training goes on
    assert trainer.amp.step_count == 2
    trainer.close()


def test_state_dicts_hold_committed_state_only_and_resume_exactly() -> None:
    trainer = Trainer(True)
    trainer.train(range(3))
    saved = copy.deepcopy(trainer.amp.state_dict())
    tail = trainer.train(range(3, 6))
    trainer.amp.zero_grad()
    trainer.backward(6)
    with pytest.raises(RuntimeError, match="after step"):
        trainer.amp.state_dict()
    if trainer.amp.optimizer.speculated_regions:
        with pytest.raises(RuntimeError, match="uncommitted speculative step"):
            trainer.amp.optimizer.state_dict()
    trainer.amp.step()
    trainer.close()
    resumed = Trainer(True)
    resumed.amp.load_state_dict(saved)
    again = resumed.train(range(3, 6))
    resumed.close()
    assert_same(again, tail)


def test_hybrid_adam_state_dict_refused_while_speculated() -> None:
    trainer = Trainer(True, host_worker=False)
    trainer.train(range(1))  # the first window speculates nothing
    trainer.backward(1)
    assert trainer.amp.optimizer.speculated_regions
    with pytest.raises(RuntimeError, match="uncommitted speculative step"):
        trainer.amp.optimizer.state_dict()
    trainer.amp.step()
    assert set(trainer.amp.optimizer.state_dict()) == {"state", "param_groups"}
    trainer.close()


def test_speculative_steps_run_on_the_modules_thread_which_closes_with_it() -> None:
    """[Note: streams and threads] in offload_runtime/streams.py: the optimizer makes no
    thread of its own; a speculative step runs on the speculation thread of the module
    it is bound to, and closing the module stops that thread."""
    options = PlanOptions(speculative=True, speculation_thread=True)
    module = offload_module(
        tiny_gpt2(), batch(0), dtype=torch.float16, host_worker=False, options=options
    )
    optimizer = HybridAdam(module.parameters(), lr=LR)
    optimizer.bind(module)
    b = batch(0)
    module.backward(loss_of(module(**b), b["input_ids"]))
    optimizer.prepare_speculation()
    r = next(st.index for st in module.storages if st.host_state)
    threads: list[str] = []
    optimizer.submit_speculation(
        r,
        None,
        hypers=optimizer.hypers(),
        timings=[],
        stepped=lambda region, part: threads.append(threading.current_thread().name),
    )
    optimizer.wait_speculation()
    assert optimizer.speculated_regions == {r}
    assert [name.split("_")[0] for name in threads] == ["offload-speculate"]
    optimizer.undo_speculation()
    thread = module.streams.speculation_thread()
    module.close()
    with pytest.raises(RuntimeError):
        thread.submit(lambda: None)


def spared_regions(amp: AMPOptimizer) -> list[int]:
    return [r for r in host_state_regions(amp) if amp.optimizer.can_speculate(r)]


def test_short_host_memory_speculates_the_regions_that_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With room for about half the buffers, the regions whose gradients land first get
    them (a suffix in forward order), a warning names the bytes, the others step after
    backward, and training equals the non-speculative run's bit for bit."""
    trainer = Trainer(True, host_worker=False, hysteresis=1)
    opt = trainer.amp.optimizer
    need = opt.speculation_bytes()
    host = host_state_regions(trainer.amp)
    host_numel = sum(st.numel for st in trainer.module.storages if st.host_state)
    assert need == 12 * host_numel, "fp32 moments: backup + two moments, 4 bytes each"
    assert len(host) >= 3
    monkeypatch.setattr(hybrid_adam_module, "_available_host_bytes", lambda: need // 2)
    fit = opt.speculative_params_that_fit()
    assert 0 < fit < host_numel
    with pytest.warns(RuntimeWarning, match=rf"{need} bytes.*regions"):
        spec = trainer.train(range(2))
    monkeypatch.undo()
    spared = spared_regions(trainer.amp)
    assert 0 < len(spared) < len(host)
    assert (
        opt.speculative_params_that_fit()
        == fit
        == sum(st.numel for st in trainer.module.storages if st.index in spared)
    )
    assert spared == sorted(host)[len(host) - len(spared) :], "the last regions first"
    allowed = int(need // 2 * hybrid_adam_module.SPECULATION_HOST_SHARE)
    assert need - opt.speculation_bytes() <= allowed
    report = trainer.amp.last_step
    assert report is not None and report.speculated_regions == len(spared)
    # An overflow in region 0 (no buffers: it steps after the answer) undoes the others.
    trainer.poison_steps = {2}
    trainer.train(range(2, 6), spec)
    trainer.close()
    assert spec.undone[2] == len(spared) and spec.skipped[2]
    assert spec.modes == {OverlapMode.DEVICE_ANSWER, OverlapMode.SPECULATIVE_UNDO}
    plain = run(False, 6, poison=(2,), host_worker=False, hysteresis=1)
    assert_same(spec, plain)


@pytest.mark.parametrize("host_kernel", ["torch", "single_pass"])
def test_speculative_params_bound_the_regions_that_speculate(host_kernel: str) -> None:
    trainer = Trainer(True, host_worker=False, host_kernel=host_kernel)
    sizes = {st.index: st.numel for st in trainer.module.storages if st.host_state}
    last_two = sorted(sizes)[-2:]
    trainer.close()
    limit = sum(sizes[r] for r in last_two)
    plain = run(False, 3, host_worker=False, host_kernel=host_kernel)
    for params, want in ((limit, last_two), (limit - 1, last_two[1:]), (0, [])):
        trainer = Trainer(True, host_worker=False, host_kernel=host_kernel)
        trainer.amp.speculative_params = params
        spec = trainer.train(range(3))
        assert spared_regions(trainer.amp) == want, params
        report = trainer.amp.last_step
        assert report is not None and report.speculated_regions == len(want)
        trainer.close()
        assert_same(spec, plain)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="speculative_params"):
            PlanOptions(speculative=True, speculative_params=bad)  # type: ignore[arg-type]


def test_bf16_moments_need_eight_bytes_per_parameter() -> None:
    trainer = Trainer(True, moments=torch.bfloat16)
    host_numel = sum(st.numel for st in trainer.module.storages if st.host_state)
    assert trainer.amp.optimizer.speculation_bytes() == 8 * host_numel
    trainer.train(range(2))  # the first window speculates nothing
    assert trainer.amp.optimizer.speculation_bytes() == 0, "allocated at the first backward"
    trainer.close()


def test_commit_publishes_are_queued_and_the_next_forward_waits_for_them() -> None:
    """step() returns while the publishes of committed regions wait on the host worker;
    the next forward blocks on them (controller.expect_updates) and then sees the new
    weights: the losses stay those of the non-speculative run."""
    trainer = Trainer(True, host_worker=True)
    trainer.train(range(1))  # the first window speculates nothing
    trainer.amp.zero_grad()
    losses = [trainer.backward(1)]
    gate = threading.Event()
    trainer.module.controller.submit_host(lambda: gate.wait(timeout=20.0))
    trainer.amp.step()  # speculative steps done in the hooks; publishes queued behind gate
    trainer.amp.zero_grad()
    waited = trainer.module.controller.update_wait_s
    timer = threading.Timer(1.0, gate.set)
    timer.start()
    losses.append(trainer.backward(2))  # its forward waits for region publishes
    # It could not finish before the gate opened, and it did block (no wall-clock bound:
    # a loaded machine makes those flaky).
    assert gate.is_set()
    timer.join()
    assert trainer.module.controller.update_wait_s > waited
    first = trainer.amp.last_step
    assert first is not None and first.overlap is OverlapMode.SPECULATIVE_UNDO
    assert first.step_end_s is not None
    # Every host-state region was published (speculated) or stepped (tail) after step().
    after = {t.region for t in first.region_steps if t.host and t.start_s >= first.step_end_s}
    assert after == set(host_state_regions(trainer.amp))
    trainer.amp.step()
    trainer.close()
    plain = run(False, 3)
    assert losses == plain.losses[1:]


def _clip_run(trainer: Trainer, clip_from: int, steps: int = 4) -> tuple[Run, list[float]]:
    """Train ``steps`` steps, clipping on demand (to 0.05) from step ``clip_from``; a step
    whose clip is refused (its speculative steps undone) runs its batch again."""
    out, norms = Run(), []
    for step in range(steps):
        trainer.amp.zero_grad()
        loss = trainer.backward(step)
        if step >= clip_from:
            try:
                norms.append(trainer.amp.clip_grad_norm(0.05))
            except RuntimeError as exc:
                assert "undone exactly" in str(exc)
                loss = trainer.backward(step)
                norms.append(trainer.amp.clip_grad_norm(0.05))
        trainer.amp.step()
        out.losses.append(loss)
        report = trainer.amp.last_step
        assert report is not None
        out.modes.add(report.overlap)
    out.masters = masters(trainer.module)
    out.state = committed_state(trainer.amp)
    return out, norms


@pytest.mark.parametrize("clip_from", [0, 2])
def test_clip_grad_norm_with_a_speculative_plan_clips_exactly(clip_from: int) -> None:
    """fp16 with a speculative plan, clipping on demand: from the first step, nothing ever
    speculates; from a later step, that step's speculative steps are undone exactly, the
    batch runs again and is clipped. Either way the values of a plan that never
    speculates, bit for bit."""
    spec_trainer, plain_trainer = (
        Trainer(True, host_worker=False),
        Trainer(False, host_worker=False),
    )
    spec, spec_norms = _clip_run(spec_trainer, clip_from)
    plain, plain_norms = _clip_run(plain_trainer, clip_from)
    spec_trainer.close()
    plain_trainer.close()
    assert_same(spec, plain)
    assert spec_norms == plain_norms and min(spec_norms) > 0.05, "every clip must clip"
    assert spec_trainer.amp.clips_on_demand
    if clip_from:
        assert OverlapMode.SPECULATIVE_UNDO in spec.modes
    else:
        assert OverlapMode.SPECULATIVE_UNDO not in spec.modes
