"""AMPOptimizer over HybridAdam trains an OffloadModule exactly as plain PyTorch would.

Every module here uses a plan that mixes all region kinds (resident / sync / async
parameters, host / device optimizer state); see optim_helpers.offload_module.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
from optim_helpers import (
    batch,
    fell,
    loss_of,
    masters,
    offload_module,
    overflow_on_device,
    region_kinds,
    rel_diff,
    tiny_gpt2,
    train_offload,
    train_plain,
)

from offload_optim import AMPOptimizer, HybridAdam, OverlapMode
from offload_runtime import OffloadConfig
from offload_runtime.module import OffloadModule
from offload_solver import PlanOptions

LR = 1e-2
WD = 0.01


def make(
    model: torch.nn.Module, *, overlap: bool = True, **amp_kwargs: Any
) -> tuple[AMPOptimizer, OffloadModule]:
    """An AMPOptimizer over the mixed plan of ``model``; ``overlap``: the plan's."""
    module = offload_module(model, batch(0), options=PlanOptions(overlap=overlap))
    opt = HybridAdam(module.parameters(), lr=LR, weight_decay=WD)
    return AMPOptimizer(opt, module, **amp_kwargs), module


def test_plan_mixes_every_region_kind() -> None:
    module = offload_module(tiny_gpt2(), batch(0))
    assert set(region_kinds(module)) == {(False, False), (False, True), (True, True), (True, False)}


def test_twenty_steps_match_adamw() -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    amp, module = make(model)
    losses = train_offload(amp, module, range(20))
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    expected = train_plain(opt, reference, range(20))
    assert fell(losses), "the run must actually train"
    assert rel_diff(losses, expected) < 1e-5
    report = amp.last_step
    assert report is not None and report.overlap is OverlapMode.SPECULATIVE
    host_regions = sum(st.host_state for st in module.storages)
    assert sum(t.host for t in report.region_steps) == host_regions
    assert amp.step_count == 20


def test_overlap_is_exact() -> None:
    """Stepping host regions in their grad-ready hooks equals stepping after backward."""
    model = tiny_gpt2()
    on, module_on = make(model, overlap=True)
    off, module_off = make(model, overlap=False)
    assert train_offload(on, module_on, range(8)) == train_offload(off, module_off, range(8))
    assert off.last_step is not None and off.last_step.overlap is OverlapMode.NONE
    for (name, a), (_, b) in zip(
        module_on.named_parameters(),
        module_off.named_parameters(),
        strict=True,
    ):
        assert torch.equal(a, b), name


def test_param_groups_split_inside_regions_match_adamw() -> None:
    """No weight decay on biases and norms: groups cut across regions, still exact."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    module = offload_module(model, batch(0))

    def groups(named: list[tuple[str, torch.Tensor]]) -> list[dict[str, object]]:
        decay = [p for n, p in named if p.dim() >= 2]
        no_decay = [p for n, p in named if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": LR / 2},
        ]

    amp = AMPOptimizer(HybridAdam(groups(list(module.named_parameters())), lr=LR), module)
    opt = torch.optim.AdamW(groups(list(reference.named_parameters())), lr=LR)
    losses = train_offload(amp, module, range(10))
    expected = train_plain(opt, reference, range(10))
    assert rel_diff(losses, expected) < 1e-5


def test_clipping_matches_clip_grad_norm() -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    amp, module = make(model, clipping_norm=0.5)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    torch_norms: list[float] = []

    def clip() -> None:
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch_norms.append(float(norm))

    ours: list[float] = []
    losses = []
    for step in range(10):
        losses += train_offload(amp, module, range(step, step + 1))
        report = amp.last_step
        assert report is not None and report.grad_norm is not None
        assert report.overlap is OverlapMode.DEVICE_ANSWER  # norm partials from the device
        ours.append(report.grad_norm)
    expected = train_plain(opt, reference, range(10), after_backward=clip)
    assert min(torch_norms) > 0.5, "every step must clip for the test to mean something"
    # The first norm comes from identical weights; later ones inherit the float-rounding
    # differences of the two runs, which grad norms amplify more than losses.
    assert abs(ours[0] - torch_norms[0]) / torch_norms[0] < 1e-6
    assert rel_diff(ours, torch_norms) < 1e-4
    assert rel_diff(losses, expected) < 1e-5


def test_clip_grad_norm_method_matches_torch() -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    amp, module = make(model, overlap=False)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    torch_norms: list[float] = []
    expected = train_plain(
        opt,
        reference,
        range(6),
        after_backward=lambda: torch_norms.append(
            float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3, norm_type=3.0))
        ),
    )
    losses, norms = [], []
    for step in range(6):
        amp.zero_grad()
        b = batch(step)
        loss = loss_of(module(**b), b["input_ids"])
        amp.backward(loss)
        norms.append(amp.clip_grad_norm(0.3, norm_type=3.0))
        amp.step()
        losses.append(loss.item())
    assert rel_diff(norms, torch_norms) < 1e-5
    assert rel_diff(losses, expected) < 1e-5


def _clipped_run(
    amp: AMPOptimizer, module: OffloadModule, steps: range, clip_from: int
) -> tuple[list[float], list[float]]:
    """Train ``steps``, clipping to 0.3 from step ``clip_from`` on: (losses, norms)."""
    losses, norms = [], []
    for step in steps:
        amp.zero_grad()
        b = batch(step)
        loss = loss_of(module(**b), b["input_ids"])
        amp.backward(loss)
        if step >= clip_from:
            norms.append(amp.clip_grad_norm(0.3))
        amp.step()
        losses.append(loss.item())
    return losses, norms


def test_clip_grad_norm_with_overlapped_host_steps_clips_exactly() -> None:
    """With the plan's overlap (bf16/fp32 host steps under backward), a loop that clips
    from its first step clips every step exactly: the first backward steps nothing early,
    and once clip_grad_norm() was called no host region steps before step()."""
    model = tiny_gpt2()
    plain, plain_module = make(copy.deepcopy(model), overlap=False)
    expected, expected_norms = _clipped_run(plain, plain_module, range(5), 0)
    amp, module = make(model)
    assert amp.overlap
    losses, norms = _clipped_run(amp, module, range(5), 0)
    assert losses == expected and norms == expected_norms
    assert amp.clips_on_demand
    assert min(norms) > 0.3, "every step must clip for the test to mean something"


def test_a_first_clip_after_host_regions_stepped_is_refused_and_clips_nothing() -> None:
    """Clipping first at step 2, after bf16/fp32 host regions stepped under backward: the
    call is refused and changes nothing (step() finishes the step unclipped, as an
    unclipped run takes it); every later step clips exactly."""
    model = tiny_gpt2()
    plain, plain_module = make(copy.deepcopy(model), overlap=False)
    losses_plain = train_offload(plain, plain_module, range(3))
    expected, _ = _clipped_run(plain, plain_module, range(3, 5), 3)
    amp, module = make(model)
    losses = train_offload(amp, module, range(2))
    amp.zero_grad()
    b = batch(2)
    loss = loss_of(module(**b), b["input_ids"])
    amp.backward(loss)
    with pytest.raises(RuntimeError, match="from the first step"):
        amp.clip_grad_norm(0.3)
    amp.step()
    losses.append(loss.item())
    assert losses == losses_plain
    later, _ = _clipped_run(amp, module, range(3, 5), 3)
    assert later == expected
    assert amp.last_step is not None and amp.last_step.overlap is OverlapMode.NONE


def test_accumulated_micro_batches_equal_one_big_batch() -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    module = offload_module(
        model, batch(0, size=4), config=OffloadConfig(dtype=torch.float32, accumulation_steps=4)
    )
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=LR, weight_decay=WD), module)
    assert amp.accumulation_steps == 4, "the module's configuration"
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    losses, expected = [], []
    for step in range(4):
        micro = [batch(step * 4 + k, size=4) for k in range(4)]
        amp.zero_grad()
        total = 0.0
        for k, b in enumerate(micro):
            loss = loss_of(module(**b), b["input_ids"]) / 4
            amp.backward(loss)
            total += loss.item()
            if k < 3:
                assert amp.step_count == step, "nothing may step while accumulating"
        if step == 0:
            grads = dict(module.named_gradients())
        amp.step()
        losses.append(total)
        big = {key: torch.cat([b[key] for b in micro]) for key in micro[0]}
        opt.zero_grad()
        ref_loss = loss_of(reference(**big), big["input_ids"])
        ref_loss.backward()  # type: ignore[no-untyped-call]
        if step == 0:
            for name, p in reference.named_parameters():
                assert p.grad is not None
                err = (grads[name] - p.grad).abs().max() / p.grad.abs().max()
                assert err < 1e-5, name
        opt.step()
        expected.append(ref_loss.item())
    assert rel_diff(losses, expected) < 1e-5


def test_accumulation_misuse_raises() -> None:
    config = OffloadConfig(dtype=torch.float32, accumulation_steps=2)
    module = offload_module(tiny_gpt2(), batch(0), config=config)
    with pytest.raises(ValueError, match=r"accumulation_steps=3\).*planned for 2"):
        AMPOptimizer(HybridAdam(module.parameters()), module, accumulation_steps=3)
    amp = AMPOptimizer(HybridAdam(module.parameters()), module, accumulation_steps=2)
    b = batch(0)
    amp.backward(loss_of(module(**b), b["input_ids"]))
    with pytest.raises(RuntimeError, match="1 of 2"):
        amp.step()
    amp.backward(loss_of(module(**b), b["input_ids"]))
    with pytest.raises(RuntimeError, match="accumulation_steps=2"):
        amp.backward(loss_of(module(**b), b["input_ids"]))
    amp.step()
    assert amp.step_count == 1


def test_step_lr_changes_the_lr_the_step_uses() -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    amp, module = make(model)
    sched = torch.optim.lr_scheduler.StepLR(amp, step_size=2, gamma=0.1)
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    losses = []
    for step in range(6):
        losses += train_offload(amp, module, range(step, step + 1))
        sched.step()
    expected = train_plain(opt, reference, range(6), sched=ref_sched)
    assert rel_diff(losses, expected) < 1e-5
    assert amp.param_groups[0]["lr"] == pytest.approx(LR * 0.1**3)

    # An lr of zero (and so no decay either) must leave every weight where it is.
    zero = torch.optim.lr_scheduler.LambdaLR(amp, lambda _: 0.0)
    before = masters(module)
    train_offload(amp, module, range(6, 8))
    del zero
    for name, p in masters(module).items():
        assert torch.equal(p, before[name]), name


def test_lr_change_after_early_step_raises() -> None:
    amp, module = make(tiny_gpt2())
    train_offload(amp, module, range(1))  # the first step's backward steps nothing early
    b = batch(1)
    amp.backward(loss_of(module(**b), b["input_ids"]))
    amp.param_groups[0]["lr"] = LR / 2
    with pytest.raises(RuntimeError, match="hyperparameters changed"):
        amp.step()


def test_rejects_other_optimizers() -> None:
    module = offload_module(tiny_gpt2(), batch(0))
    with pytest.raises(TypeError, match="HybridAdam"):
        AMPOptimizer(torch.optim.AdamW(module.parameters()), module)


def test_unbound_hybrid_adam_on_masters_names_the_fix() -> None:
    module = offload_module(tiny_gpt2(), batch(0))
    opt = HybridAdam(module.parameters())
    with pytest.raises(RuntimeError, match="AMPOptimizer"):
        opt.step()


# ---- fp16 ------------------------------------------------------------------------------


def fp16_setup(
    hysteresis: int, inject: dict[str, int], target_host_state: bool = True, **kwargs: Any
) -> tuple[AMPOptimizer, OffloadModule, int]:
    """fp16 module whose chosen region's gradient turns inf when ``inject['now']`` is set.

    The injecting hook is registered before AMPOptimizer's, so AMPOptimizer sees the inf
    in its own hooks: it is an overflow *during* backward, as a real one would be (on the
    device for a host-state region, in the accumulator for a device-state one).
    """
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16)
    target = next(
        st.index
        for st in module.storages
        if st.host_state == target_host_state and st.index not in (0,)
    )

    if target_host_state:
        overflow_on_device(module, lambda r: bool(inject["now"]) and r == target)
    else:

        def poison(r: int) -> None:
            if inject["now"] and r == target:
                module.storages[r].grad[3] = math.inf

        module.controller.add_grad_ready_hook(poison)
    opt = HybridAdam(module.parameters(), lr=LR)
    amp = AMPOptimizer(opt, module, hysteresis=hysteresis, **kwargs)
    return amp, module, target


def optimizer_state(amp: AMPOptimizer) -> list[torch.Tensor]:
    return [t.clone() for st in amp.state.values() for t in st.values()]


@pytest.mark.parametrize("host_state", [True, False])
def test_forced_overflow_skips_that_step_and_halves_the_scale(host_state: bool) -> None:
    inject = {"now": 0}
    amp, module, _ = fp16_setup(1, inject, host_state)
    train_offload(amp, module, range(2))
    scale = amp.loss_scale
    before_w, before_s = masters(module), optimizer_state(amp)
    inject["now"] = 1
    train_offload(amp, module, range(2, 3))
    report = amp.last_step
    assert report is not None and report.skipped
    assert amp.loss_scale == scale / 2
    assert amp.step_count == 2
    after_w = masters(module)
    assert all(torch.equal(after_w[n], before_w[n]) for n in before_w)
    assert all(torch.equal(a, b) for a, b in zip(optimizer_state(amp), before_s, strict=True))
    inject["now"] = 0
    train_offload(amp, module, range(3, 4))
    assert amp.last_step is not None and not amp.last_step.skipped
    assert amp.step_count == 3
    assert not torch.equal(
        masters(module)["model.transformer.wpe.weight"], before_w["model.transformer.wpe.weight"]
    )


def test_hysteresis_two_halves_on_the_second_overflow() -> None:
    inject = {"now": 0}
    amp, module, _ = fp16_setup(2, inject)
    scale = amp.loss_scale
    inject["now"] = 1
    train_offload(amp, module, range(1))
    assert amp.last_step is not None and amp.last_step.skipped
    assert amp.loss_scale == scale, "the first overflow only skips"
    train_offload(amp, module, range(1, 2))
    assert amp.last_step.skipped
    assert amp.loss_scale == scale / 2, "the second one backs off"
    train_offload(amp, module, range(2, 3))
    assert amp.loss_scale == scale / 4, "and so does every one after, until the scale grows"
    inject["now"] = 0
    train_offload(amp, module, range(3, 4))
    assert not amp.last_step.skipped and amp.step_count == 1


def test_fp16_scale_grows_and_training_works() -> None:
    inject = {"now": 0}
    amp, module, _ = fp16_setup(2, inject, growth_interval=3, initial_scale=2.0**10)
    losses = train_offload(amp, module, range(12))
    assert amp.loss_scale == 2.0**14
    assert amp.step_count == 12
    assert fell(losses)
    assert amp.last_step is not None and amp.last_step.overlap is OverlapMode.DEVICE_ANSWER


def test_fp16_overflow_from_a_huge_scale_backs_off_to_a_working_one() -> None:
    inject = {"now": 0}
    amp, module, _ = fp16_setup(1, inject, initial_scale=2.0**30, max_scale=2.0**32)
    losses = train_offload(amp, module, range(16))
    assert amp.loss_scale < 2.0**30
    assert 0 < amp.step_count < 16
    assert fell(losses, 0.0)


def test_fp16_step_without_amp_backward_raises() -> None:
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16)
    amp = AMPOptimizer(HybridAdam(module.parameters()), module)
    b = batch(0)
    module.backward(loss_of(module(**b), b["input_ids"]))
    with pytest.raises(RuntimeError, match=r"amp\.backward"):
        amp.step()


# ---- bf16 ------------------------------------------------------------------------------


def test_bf16_trains_without_scaling() -> None:
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.bfloat16)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=LR), module)
    seen: list[float] = []
    original = module.backward

    def spy(loss: torch.Tensor) -> None:
        seen.append(loss.item())
        original(loss)

    module.backward = spy  # type: ignore[method-assign]
    losses = train_offload(amp, module, range(15))
    assert amp.loss_scale == 1.0
    assert seen == pytest.approx(losses, rel=0, abs=0), "the loss must reach backward unscaled"
    assert fell(losses)
    assert amp.last_step is not None and amp.last_step.overlap is OverlapMode.SPECULATIVE
    assert not any(r.skipped for r in [amp.last_step])


def test_recent_steps_keep_every_step_in_order() -> None:
    """keep_reports=3: the last three steps' reports, oldest first, the newest equal to
    last_step, and one host worker: a step's host steps end before the next one's start."""
    amp, module = make(tiny_gpt2(), keep_reports=3)
    train_offload(amp, module, range(5))
    reports = amp.recent_steps()
    assert [r.step for r in reports] == [3, 4, 5]
    assert reports[-1] == amp.last_step
    host_regions = sum(st.host_state for st in module.storages)
    assert host_regions > 0
    for earlier, later in itertools.pairwise(reports):
        first = [t for t in earlier.region_steps if t.host]
        second = [t for t in later.region_steps if t.host]
        assert len(first) == len(second) == host_regions
        assert max(t.end_s for t in first) <= min(t.start_s for t in second)
        assert earlier.backward_start_s is not None and later.backward_start_s is not None
        assert earlier.backward_start_s < later.backward_start_s


def test_recent_steps_are_off_by_default_and_refuse_bad_counts() -> None:
    amp, module = make(tiny_gpt2())
    train_offload(amp, module, range(2))
    assert amp.recent_steps() == []
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="keep_reports"):
            make(tiny_gpt2(), keep_reports=bad)
