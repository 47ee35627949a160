"""On a CUDA device: overlapped, speculative, fp16-I/O and streamed host steps train as the
synchronous host step does. Small models: none of these needs more than a few hundred MiB
of device memory. How fast the host step runs and how much of it hides under backward is
the benchmark's to measure (``benchmarks/offload_bench.py``), not a test's.

Run with ``nox -s gpu_tests``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from optim_helpers import (
    batch,
    loss_of,
    masters,
    offload_module,
    overflow_on_device,
    rel_diff,
    tiny_gpt2,
)

from offload_optim import AMPOptimizer, HybridAdam, OverlapMode, check_stream_rate
from offload_runtime import OffloadConfig
from offload_runtime.host_kernels import single_pass
from offload_runtime.module import OffloadModule
from offload_solver import PlanOptions

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def cuda_batch(step: int, size: int = 4) -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA) for k, v in batch(step, size).items()}


def poison_region(module: OffloadModule, r: int) -> dict[str, bool]:
    """Put an inf in region ``r``'s device gradients, as a real overflow, in every backward
    while the returned flags' ``"now"`` is set (the norm partials are taken there)."""
    poison = {"now": False}
    overflow_on_device(module, lambda q: poison["now"] and q == r)
    return poison


def test_cuda_mixed_plan_matches_adamw_and_overlap_changes_nothing() -> None:
    """fp32 on CUDA, every region kind: AdamW's losses, with and without the overlap."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model).to(CUDA)
    runs = {}
    for overlap in (True, False):
        options = PlanOptions(overlap=overlap)
        module = offload_module(model, batch(0), device=CUDA, options=options)
        opt = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01)
        amp = AMPOptimizer(opt, module)
        losses = []
        for step in range(10):
            amp.zero_grad()
            b = cuda_batch(step)
            loss = loss_of(module(**b), b["input_ids"])
            amp.backward(loss)
            amp.step()
            losses.append(loss.item())
        runs[overlap] = losses
        assert amp.last_step is not None
        want = OverlapMode.SPECULATIVE if overlap else OverlapMode.NONE
        assert amp.last_step.overlap is want
        module.close()
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for step in range(10):
        opt_ref.zero_grad()
        b = cuda_batch(step)
        loss = loss_of(reference(**b), b["input_ids"])
        loss.backward()  # type: ignore[no-untyped-call]
        opt_ref.step()
        expected.append(loss.item())
    # CUDA backward is not bitwise deterministic (atomic adds), so a tolerance here.
    assert rel_diff(runs[True], expected) < 1e-5
    assert rel_diff(runs[False], expected) < 1e-5


def test_cuda_fp16_overflow_skips_and_clipping_runs() -> None:
    module = offload_module(tiny_gpt2(), batch(0), dtype=torch.float16, device=CUDA)
    target = next(st.index for st in module.storages if st.host_state and st.index > 0)
    poison = poison_region(module, target)
    opt = HybridAdam(module.parameters(), lr=1e-2)
    amp = AMPOptimizer(opt, module, hysteresis=1, clipping_norm=1.0)

    def run(step: int) -> None:
        amp.zero_grad()
        b = cuda_batch(step)
        amp.backward(loss_of(module(**b), b["input_ids"]))
        amp.step()

    run(0)
    before = masters(module)
    scale = amp.loss_scale
    poison["now"] = True
    run(1)
    assert amp.last_step is not None and amp.last_step.skipped
    assert amp.loss_scale == scale / 2
    after = masters(module)
    assert all(torch.equal(after[n], before[n]) for n in before)
    poison["now"] = False
    run(2)
    assert not amp.last_step.skipped and amp.last_step.grad_norm is not None
    assert amp.last_step.overlap is OverlapMode.DEVICE_ANSWER
    module.close()


Runs = dict[bool, tuple[list[float], dict[str, torch.Tensor], list[bool]]]


def assert_same_runs(results: Runs, skipped: list[bool]) -> None:
    """Both runs skipped the steps ``skipped`` says and have the same losses and masters,
    bit for bit."""
    assert results[True][2] == results[False][2] == skipped
    assert results[True][0] == results[False][0]
    for name, value in results[False][1].items():
        assert torch.equal(results[True][1][name], value), name


@pytest.mark.parametrize("micro", [1, 2])
def test_cuda_fp16_device_answer_equals_synchronous_training(micro: int) -> None:
    """fp16 on CUDA without clipping (DEVICE_ANSWER: the overflow partials taken on the
    compute stream before each host-state region's gradients leave, summed over
    micro-batches; host steps in the hooks of regions landing after the answer):
    bit-identical masters and losses to overlap=False over 8 steps, one of them
    overflowing on the device (in its first micro-batch only)."""
    model = tiny_gpt2()
    results: Runs = {}
    for overlap in (True, False):
        module = offload_module(
            model,
            batch(0),
            dtype=torch.float16,
            device=CUDA,
            options=PlanOptions(overlap=overlap),
            config=OffloadConfig(accumulation_steps=micro),
        )
        target = next(st.index for st in module.storages if st.host_state and st.index > 0)
        poison = {"now": False, "region": target}

        def when(r: int, p: dict[str, Any] = poison) -> bool:
            return bool(p["now"]) and r == p["region"]

        overflow_on_device(module, when)
        opt = HybridAdam(module.parameters(), lr=1e-3, weight_decay=0.01)
        amp = AMPOptimizer(
            opt,
            module,
            initial_scale=2.0**10,
            hysteresis=1,
        )
        losses: list[torch.Tensor] = []
        skipped: list[bool] = []
        for step in range(8):
            amp.zero_grad()
            for k in range(micro):
                poison["now"] = step == 5 and k == 0
                b = cuda_batch(step * micro + k)
                loss = loss_of(module(**b), b["input_ids"]) / micro
                amp.backward(loss)
                losses.append(loss.detach())
            amp.step()
            report = amp.last_step
            assert report is not None
            assert report.overlap is (OverlapMode.DEVICE_ANSWER if overlap else OverlapMode.NONE)
            skipped.append(report.skipped)
        results[overlap] = ([float(x) for x in losses], masters(module), skipped)
        module.close()
    assert_same_runs(results, skipped=[False] * 5 + [True] + [False] * 2)


def test_cuda_fp16_host_steps_overlapping_the_next_forward_change_nothing() -> None:
    """fp16 on CUDA, every region kind, on the host worker thread: the host steps that
    step() leaves queued (published on the h2d stream from that thread) give the training
    and eval losses of the synchronous run, with accumulation, clipping and an lr schedule.
    """
    model = tiny_gpt2()
    runs: dict[bool, list[float]] = {}
    for overlap in (True, False):
        module = offload_module(
            model,
            batch(0),
            dtype=torch.float16,
            device=CUDA,
            options=PlanOptions(overlap=overlap),
            config=OffloadConfig(accumulation_steps=2),
        )
        opt = HybridAdam(module.parameters(), lr=1e-3, weight_decay=0.01)
        amp = AMPOptimizer(opt, module, initial_scale=2.0**10, clipping_norm=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(amp, lambda s: 1.0 / (1.0 + s))
        losses: list[torch.Tensor] = []  # read after the loop: .item() would sync each step
        for step in range(8):
            amp.zero_grad()
            for k in range(2):
                b = cuda_batch(2 * step + k)
                loss = loss_of(module(**b), b["input_ids"]) / 2
                amp.backward(loss)
                losses.append(loss.detach())
            amp.step()
            sched.step()
            module.eval()
            with torch.no_grad():  # an eval forward waits for the queued steps too
                b = cuda_batch(1000)
                losses.append(loss_of(module(**b), b["input_ids"]))
            module.train()
        report = amp.last_step
        assert report is not None
        assert report.overlap is (OverlapMode.PARTIALS if overlap else OverlapMode.NONE)
        assert amp.step_count == 8, "no step may overflow for the comparison to hold"
        runs[overlap] = [float(x) for x in losses]
        print(
            f"\noverlap={overlap}: host steps after step() returned "
            f"{report.after_step_fraction():.0%}, forward waited "
            f"{module.controller.update_wait_s * 1e3:.1f} ms in all"
        )
        module.close()
    # Gradients differ in the last bits between CUDA runs (atomic adds in backward); fp16
    # weights round those differences up to the half-precision step size.
    assert rel_diff(runs[True], runs[False]) < 5e-3


@pytest.mark.skipif(not single_pass.fp16_io_available(), reason="numba or F16C missing")
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32m", "bf16m"])
@pytest.mark.parametrize("speculate", [False, True], ids=["after_backward", "speculate"])
def test_cuda_fp16_io_equals_the_three_pass_route(speculate: bool, moments: torch.dtype) -> None:
    """fp16 on CUDA with a plan of fp16 I/O: the host steps read the fp16 gradients
    from the pinned staging buffers the d2h copies filled and write the upload copies the
    h2d copies read. Losses, masters and skip decisions equal the single-pass run without
    fp16 I/O bit for bit over 8 steps, one of them overflowing on the device (undone, when
    speculating), with fp32 or bf16 host moments."""
    model = tiny_gpt2()
    results: Runs = {}
    for fp16_io in (True, False):
        options = PlanOptions(
            host_kernel="single_pass",
            fp16_io=fp16_io,
            speculative=speculate,
            speculation_thread=speculate,
        )
        module = offload_module(
            model,
            batch(0),
            dtype=torch.float16,
            device=CUDA,
            options=options,
            config=OffloadConfig(host_state="fp32" if moments == torch.float32 else "bf16_moments"),
        )
        assert any(st.host_state and st.offloaded for st in module.storages)
        assert any(st.host_state and not st.offloaded for st in module.storages)
        poison = poison_region(module, 0)
        opt = HybridAdam(module.parameters(), lr=1e-3, weight_decay=0.01)
        amp = AMPOptimizer(opt, module, initial_scale=2.0**10, hysteresis=1)
        losses: list[torch.Tensor] = []
        skipped: list[bool] = []
        for step in range(8):
            amp.zero_grad()
            poison["now"] = step == 5
            b = cuda_batch(step)
            loss = loss_of(module(**b), b["input_ids"])
            amp.backward(loss)
            losses.append(loss.detach())
            amp.step()
            report = amp.last_step
            assert report is not None
            skipped.append(report.skipped)
        results[fp16_io] = ([float(x) for x in losses], masters(module), skipped)
        module.close()
    assert_same_runs(results, skipped=[False] * 5 + [True] + [False] * 2)


@pytest.mark.skipif(not single_pass.fp16_io_available(), reason="numba or F16C missing")
@pytest.mark.parametrize(
    ("speculation_thread", "stage_in_backward"),
    [(True, True), (False, False)],
    ids=["defaults", "hooks_speculate_unstaged"],
)
def test_cuda_streamed_regions_step_on_the_device(
    monkeypatch: pytest.MonkeyPatch, speculation_thread: bool, stage_in_backward: bool
) -> None:
    """Host-state regions marked streamed step on the GPU (their state up, torch's fused
    CUDA Adam, state and fp16 copy down) while region 0 steps on the host, with fp16 I/O,
    bf16 moments and speculative steps: one step equals the all-host run's within
    rounding (torch's CUDA update against the single-pass host kernel), the overflow at
    step 5 is skipped in both, and 8 steps stay within 1e-3 of its losses. step()'s
    streamed regions are issued from the issuing thread, which waits on the host for each
    slot's CUDA event ([Note: paced ring] in streamed/ring.py). With ``speculation_thread``
    the speculative steps run on their own thread; with ``stage_in_backward`` the
    backward's first streamed hook stages the leading chunks' master weights and moments,
    and the step copies up their gradients ([Note: staging the state in backward] in
    streamed/ring.py)."""
    import threading

    import offload_runtime.planning.streamed_costs as stream_costs
    from offload_optim.streamed import StreamRing

    issued: dict[str, Any] = {"pieces": 0, "threads": set(), "state_staged": 0}
    issue = StreamRing.issue
    stage = StreamRing.stage

    def staging(self: StreamRing, *tensors: Any) -> bool:
        issued["state_staged"] += 1
        return stage(self, *tensors)

    def counting(self: StreamRing, pieces: list[Any], grad_scale: float | None, **kw: Any) -> Any:
        issued["pieces"] += len(pieces)
        issued["threads"].add(threading.current_thread().name.split("_")[0])
        return issue(self, pieces, grad_scale, **kw)

    monkeypatch.setattr(StreamRing, "issue", counting)
    monkeypatch.setattr(StreamRing, "stage", staging)
    monkeypatch.setattr(stream_costs, "STREAM_CHUNK_NUMEL", 1000)  # ragged chunks
    model = tiny_gpt2()
    runs: dict[bool, tuple[list[float], dict[str, torch.Tensor], list[bool]]] = {}
    first: dict[bool, dict[str, torch.Tensor]] = {}
    for stream in (True, False):
        options = PlanOptions(
            host_kernel="single_pass",
            fp16_io=True,
            speculative=True,
            speculation_thread=speculation_thread,
            stage_in_backward=stage_in_backward,
        )
        module = offload_module(
            model,
            batch(0),
            dtype=torch.float16,
            device=CUDA,
            options=options,
            config=OffloadConfig(host_state="bf16_moments"),
        )
        host = [st for st in module.storages if st.host_state]
        assert len(host) >= 2 and host[0].index == 0
        if stream:
            for st in host[1:]:
                st.streamed = True
        poison = poison_region(module, 0)
        opt = HybridAdam(module.parameters(), lr=1e-3, weight_decay=0.01)
        amp = AMPOptimizer(opt, module, initial_scale=2.0**10, hysteresis=1, keep_reports=8)
        losses: list[float] = []
        skipped: list[bool] = []
        for step in range(8):
            amp.zero_grad()
            poison["now"] = step == 5
            b = cuda_batch(step)
            loss = loss_of(module(**b), b["input_ids"])
            amp.backward(loss)
            amp.step()
            losses.append(loss.item())
            report = amp.last_step
            assert report is not None
            skipped.append(report.skipped)
            if step == 0:
                first[stream] = masters(module)
            if step == 2:
                reserved = torch.cuda.memory_reserved()
            if stream:
                steps = {t.region: t.streamed for t in report.region_steps}
                assert all(steps.get(st.index, True) for st in host[1:])
                # Region 0 steps on the host. In the skipped step (5) it steps only if its
                # hook found backward still running on the device (a speculative step,
                # then undone); when backward was already over, the skip answer leaves it
                # unstepped and the report has no timing for it.
                if not report.skipped or 0 in steps:
                    assert steps.get(0) is False
        # Each step's ring reuses the last one's memory (the same streams). Rings on new
        # streams each step reserved at least a 2 MiB segment more per step (5 here).
        assert torch.cuda.memory_reserved() - reserved < 4 << 20
        if stream:
            for st in host[1:]:
                if st.offloaded:
                    assert st.host_params is not None
                    assert torch.equal(st.host_params, st.master.half())
            assert issued["pieces"] > 0
            assert (opt.staged_chunks > 0) == stage_in_backward
            assert (issued["state_staged"] > 0) == stage_in_backward
            assert "offload-stream-issue" in issued["threads"]
            # The ring's copies up were timed on the device ([Note: timing the ring's
            # copies up] in streamed/ring.py): bytes and seconds for some regions (how
            # fast is the bench's).
            up = [
                (t.up_bytes, t.up_s)
                for rep in amp.recent_steps()
                for t in rep.region_steps
                if t.streamed
            ]
            timed = [(n, sec) for n, sec in up if n > 0]
            assert timed and sum(sec for _, sec in timed) > 0
            check = check_stream_rate(amp)
            if check is not None:  # a module planned with a hardware profile
                assert 0 < check.loop_fraction <= 1
        runs[stream] = (losses, masters(module), skipped)
        module.close()
    assert runs[True][2] == runs[False][2] == [False] * 5 + [True] + [False] * 2
    for name, value in first[True].items():
        torch.testing.assert_close(value, first[False][name], rtol=0, atol=1e-6)
    assert rel_diff(runs[True][0], runs[False][0]) < 1e-3


def test_cuda_streamed_moments_are_pinned_at_their_exact_size() -> None:
    """A streamed region's moments cross PCIe at every step, so they are page-locked, in
    place at their exact size rather than by PyTorch's caching host allocator, which
    rounds each buffer up to a power of two (up to twice the host memory; see [Note:
    exact-size pinned memory] in offload_runtime.storage)."""
    module = offload_module(
        tiny_gpt2(layers=1, width=512),
        batch(0),
        dtype=torch.float16,
        device=CUDA,
        config=OffloadConfig(host_state="bf16_moments"),
    )
    big = [st for st in module.storages if st.host_state and st.numel * 2 >= 1 << 20]
    assert big, "the plan has host-state regions of at least 1 MiB of bf16 moments"
    for st in big:
        assert st.master.is_pinned()
        st.streamed = True
    before = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    opt = HybridAdam(module.parameters(), lr=1e-3)
    opt.bind(module)
    assert opt.region_indices  # lays the regions out: their moments are made now
    after = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    for st in big:
        rs = opt._layout.regions[st.index]
        for moment in (rs.exp_avg, rs.exp_avg_sq):
            assert moment.is_pinned() and moment.numel() == st.numel
            assert int(torch.count_nonzero(moment)) == 0
    assert after == before, "no moment came from the caching host allocator"
    module.close()


def test_cuda_host_rate_check_reads_the_loop_and_plans_again_with_it() -> None:
    """check_host_rate on a CUDA plan whose state is all on the host (fp16, steps after
    the answer): the loop's host busy time per step and the rate that matches it, which a
    plan made again with it takes as its host rate."""
    import math

    from optim_helpers import plan_at_least_budget

    from offload_optim import check_host_rate, planned_host_busy_s
    from offload_solver import default_hardware

    def plan(model: torch.nn.Module, **kwargs: Any) -> OffloadModule:
        options: dict[str, Any] = {
            "hardware": default_hardware(),
            "device": CUDA,
            "block_search_range_bytes": 0,
            "state_on_device": False,
            **kwargs,
        }
        return plan_at_least_budget(model, cuda_batch(0), scale=2, **options)

    module = plan(tiny_gpt2())
    assert any(st.host_state for st in module.storages)
    amp = AMPOptimizer(
        HybridAdam(module.parameters(), lr=1e-3), module, initial_scale=2.0**10, keep_reports=6
    )
    for step in range(6):
        amp.zero_grad()
        b = cuda_batch(step)
        amp.backward(loss_of(module(**b), b["input_ids"]))
        amp.step()
    check = check_host_rate(amp, last=4)
    assert check is not None
    assert 1 <= check.steps <= 4
    assert check.planned_busy_s == planned_host_busy_s(module.plan) > 0
    assert check.measured_busy_s > 0
    assert math.isfinite(check.loop_params_per_s) and check.loop_params_per_s > 0
    module.close()
    again = plan(tiny_gpt2(), host_step_params_per_s=check.loop_params_per_s)
    assert again.hardware is not None
    assert again.hardware.host_adam_params_per_s == pytest.approx(check.loop_params_per_s)
    again.close()


def test_cuda_a_dropped_module_and_optimizer_return_their_device_memory_at_once() -> None:
    """``del module, optimizer`` gives their device memory back by reference counts alone,
    with the cyclic collector off: a next model is planned against the whole device."""
    import gc

    from optim_helpers import plan_at_least_budget

    from offload_runtime.planning import measure_device_bytes_in_use

    measure_device_bytes_in_use(CUDA)  # the BLAS workspaces, allocated for good
    before = torch.cuda.memory_allocated(CUDA)
    module = plan_at_least_budget(
        tiny_gpt2(), cuda_batch(0), scale=2, dtype=torch.float16, device=CUDA
    )
    optimizer = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-3), module)
    for step in range(3):
        inp = cuda_batch(step)
        optimizer.backward(loss_of(module(**inp), inp["input_ids"]))
        optimizer.step()
        optimizer.zero_grad()
    del inp
    optimizer.synchronize()
    held = torch.cuda.memory_allocated(CUDA) - before
    assert held > 0
    gc.collect()  # planning's own cyclic garbage (traced graphs), as a long run's collector
    gc.disable()
    try:
        del module, optimizer
        torch.cuda.synchronize(CUDA)
        left = torch.cuda.memory_allocated(CUDA) - before
    finally:
        gc.enable()
    assert left <= 2**20, f"{left} of {held} bytes still allocated after the drop"


def test_cuda_bf16_master_rungs_train_from_their_pinned_bf16_masters() -> None:
    """The bf16-master rungs on CUDA, every region's state on the host (offloaded and
    resident regions): the host master is pinned bf16 and is the upload source itself;
    ``bf16_nearest`` trains as torch's fused AdamW over the bf16 model on the device (the
    same rounding; the traced graph's gradients differ from eager's by bf16 rounding), and
    stochastic rounding and 8-bit moments end close to it."""
    model = tiny_gpt2().to(torch.bfloat16)
    reference = copy.deepcopy(model).to(CUDA)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    plain = []
    for step in range(10):
        opt.zero_grad()
        b = cuda_batch(step)
        loss = loss_of(reference(**b), b["input_ids"])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        plain.append(loss.item())
    runs = {}
    for state in ("bf16_nearest", "bf16_stochastic", "bf16_8bit"):
        config = OffloadConfig(dtype=torch.bfloat16, host_state=state)
        module = offload_module(
            model, batch(0), dtype=torch.bfloat16, device=CUDA, all_host_state=True, config=config
        )
        assert any(st.offloaded for st in module.storages)
        for st in module.storages:
            assert st.master.dtype == torch.bfloat16 and st.master.is_pinned()
            assert st.master_is_upload_copy
        amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
        losses = []
        for step in range(10):
            amp.zero_grad()
            b = cuda_batch(step)
            loss = loss_of(module(**b), b["input_ids"])
            amp.backward(loss)
            amp.step()
            losses.append(loss.item())
        amp.synchronize()
        runs[state] = losses
    assert rel_diff(runs["bf16_nearest"], plain) < 2e-2
    for state in ("bf16_stochastic", "bf16_8bit"):
        assert runs[state][-1] < 0.97 * runs[state][0], state  # 10 steps: it trains
        assert abs(runs[state][-1] / runs["bf16_nearest"][-1] - 1) < 0.05, state
