"""``compute_fidelity.measured_steps`` on a hand-made trace and on a recorded one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from compute_fidelity import mean_by_op, measured_steps, op_kind
from step_trace import load_trace

RESULTS = Path(__file__).resolve().parent.parent / "results"
MAIN, AUTOGRAD, COMPUTE, OTHER = 1, 2, 7, 9


def _launch(ts: float, tid: int, corr: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "tid": tid, "args": {"correlation": corr}}  # fmt: skip


def _kernel(
    ts: float, dur: float, corr: int, name: str = "gemm", stream: int = COMPUTE
) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": stream,
            "args": {"correlation": corr}}  # fmt: skip


def _backward_op(ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0",
            "ts": ts, "dur": dur, "tid": AUTOGRAD}  # fmt: skip


def test_kernels_split_by_launching_thread_and_backward_pass() -> None:
    # Step 1: forward kernels (main thread) at 0 and 100 us, backward ops at 1000-1300
    # launching two kernels; step 2: a forward kernel at 2000, a fused Adam kernel (left
    # out), a kernel on another stream (left out), backward at 3000 launching one.
    events = [
        _launch(0, MAIN, 1), _kernel(10, 50, 1),
        _launch(100, MAIN, 2), _kernel(110, 30, 2),
        _backward_op(1000, 100), _launch(1010, AUTOGRAD, 3), _kernel(1020, 200, 3),
        _backward_op(1200, 100), _launch(1210, AUTOGRAD, 4), _kernel(1300, 100, 4),
        _launch(2000, MAIN, 5), _kernel(2010, 40, 5),
        _launch(2100, MAIN, 6), _kernel(2110, 500, 6, name="multi_tensor_apply_kernel"),
        _launch(2200, MAIN, 7), _kernel(2210, 900, 7, stream=OTHER),
        _backward_op(3000, 100), _launch(3010, AUTOGRAD, 8), _kernel(3020, 300, 8),
    ]  # fmt: skip
    steps = measured_steps(events)
    assert len(steps) == 2
    first, second = steps
    assert first.forward.busy_ms == pytest.approx(0.08) and first.forward.kernels == 2
    assert first.forward.span_ms == pytest.approx(0.13)  # 10 us to 140 us
    assert first.backward.busy_ms == pytest.approx(0.3)
    assert first.backward.span_ms == pytest.approx(0.38)  # 1020 us to 1400 us
    assert first.call_lag_ms == pytest.approx(0.02)  # call at 1000 us, kernel at 1020
    assert first.forward_after_call_ms == 0.0 and first.forward.gaps_ms == ()
    assert second.forward.busy_ms == pytest.approx(0.04) and second.forward.kernels == 1
    assert second.backward.busy_ms == pytest.approx(0.3) and second.backward.kernels == 1


def _aten(name: str, ts: float, dur: float, tid: int) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": f"aten::{name}", "ts": ts, "dur": dur, "tid": tid}


def test_kernels_are_charged_to_the_outermost_aten_op_around_their_launch() -> None:
    # aten::linear (0-50 us) holds aten::addmm (5-45 us), which launches the first kernel;
    # aten::mul (60-70 us) launches the second; the third launch has no operator around it.
    events = [
        _aten("linear", 0, 50, MAIN), _aten("addmm", 5, 40, MAIN),
        _launch(10, MAIN, 1), _kernel(10, 100, 1),
        _aten("mul", 60, 10, MAIN), _launch(65, MAIN, 2), _kernel(110, 20, 2),
        _launch(80, MAIN, 3), _kernel(130, 5, 3),
        _backward_op(1000, 100), _aten("mm", 1005, 50, AUTOGRAD),
        _launch(1010, AUTOGRAD, 4), _kernel(1020, 200, 4),
    ]  # fmt: skip
    (step,) = measured_steps(events)
    assert step.forward.by_op == pytest.approx({"linear": 0.1, "mul": 0.02, "?": 0.005})
    assert step.backward.by_op == pytest.approx({"mm": 0.2})
    assert mean_by_op([{"mm": 1.0}, {"mm": 3.0, "mul": 2.0}]) == {"mm": 2.0, "mul": 1.0}


def test_op_kind_drops_the_node_number() -> None:
    assert op_kind("addmm_12") == "addmm"
    assert op_kind("scaled_dot_product_attention") == "scaled_dot_product_attention"
    assert op_kind("view_3") == "view"


def test_no_backward_no_steps() -> None:
    assert measured_steps([_launch(0, MAIN, 1), _kernel(10, 50, 1)]) == []


def test_recorded_w3_trace_runs_the_same_kernels_each_step() -> None:
    # Session 34, W3: 86.5-86.7 ms of forward kernels and 160.5-160.8 ms of backward
    # kernels in each of the two profiled steps.
    doc: Any = load_trace(RESULTS / "s34c4_trace_W3.json.gz")
    steps = measured_steps(doc["traceEvents"])
    assert len(steps) == 2
    # The CPU ran ahead in the second step: backward's first kernel 35.2 ms after its
    # call, and the forward idled in gaps waiting for the host (BENCHMARKS.md, session 34).
    assert 35 < steps[1].call_lag_ms < 35.5 and steps[0].call_lag_ms < 3
    assert [round(g) for g in steps[1].forward.gaps_ms if g > 20] == [36, 29, 44, 44]
    for s in steps:
        assert 86 < s.forward.busy_ms < 87.5
        assert 160 < s.backward.busy_ms < 161.5
        assert s.backward.kernels == 2253
        # Attention's kernels: 20.8 ms of the forward; its backward 30.8 ms.
        assert 20 < s.forward.by_op["scaled_dot_product_attention"] < 21.5
        assert 30 < s.backward.by_op["_scaled_dot_product_flash_attention_backward"] < 31.5


def test_compute_model_options_reach_the_hardware_profile() -> None:
    import argparse

    from plan_predict import add_compute_model_args, replay_hardware, with_compute_model

    parser = argparse.ArgumentParser()
    add_compute_model_args(parser, "price")
    hw = replay_hardware(op_overhead_us=19.0, host_convert_gelem=0.0)
    same = with_compute_model(hw, parser.parse_args([]))
    assert same == hw  # off by default
    args = parser.parse_args(["--issue-ahead", "--attention-fwd", "125", "--attention-bwd", "230"])
    set_ = with_compute_model(hw, args)
    assert set_.issue_ahead
    assert (set_.attention_fwd_flop_per_s, set_.attention_bwd_flop_per_s) == (125e12, 230e12)


def test_a_fused_gelu_row_is_priced_as_it_ran(capsys: pytest.CaptureFixture[str]) -> None:
    # Session 37's fused W3 row (fuse_gelu in the row): priced as the fused trace, the
    # forward is 76.4 ms at the row's profile; as written it was 93.3 (BENCHMARKS.md).
    import json

    from compute_fidelity import main, simulated

    row = json.loads((RESULTS / "s37c3_W3.json").read_text())["results"]["W3"]
    ours = row["ours_io_spec1_stream"]
    assert ours["fuse_gelu"] is True
    fused = simulated("W1", ours["profile"], fuse_gelu=True)
    plain = simulated("W1", ours["profile"])
    # Seven fewer operations a layer each way, each at least its issue cost (24 layers).
    issue_ms = ours["profile"]["op_overhead_us"] / 1e3
    assert plain.forward_ms - fused.forward_ms >= 24 * 7 * issue_ms * 0.99
    assert plain.backward_ms > fused.backward_ms
    assert main([str(RESULTS / "s37c3_W3.json"), str(RESULTS / "s37c3_trace_W3.json.gz")]) == 0
    assert "simulated: forward 76.4 ms" in capsys.readouterr().out
