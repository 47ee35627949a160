"""offload_bench.py's measurements run on the CPU: the rows of ours at tiny workloads (the
same code as on a GPU but for the device), full-GPU training's recipe, and the timing
helpers on fake clocks and steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import offload_bench
import pytest
import torch
from offload_bench import (
    cpu_span_summary,
    interleaved_steps,
    pair_summary,
    reprofile_if_disturbed,
)


def test_each_row_of_ours_records_its_steps_plan_and_floor(
    cpu_rows: dict[str, dict[str, Any]],
) -> None:
    for kind, row in cpu_rows.items():
        assert row["timed_steps"] == len(row["steps_ms"]) == 5, kind
        assert 0 < min(row["steps_ms"]) <= row["step_ms"] <= row["step_mean_ms"]
        assert row["pred_step_ms"] > 0 and row["pred_peak_gib"] > 0
        assert row["config"] == offload_bench.dataclasses.asdict(offload_bench.OURS[kind])
        # Every row's floor has its host memory part (the rows read the bandwidth at
        # conftest's CPU_HOST_MEMORY_GBPS); only fp32 host state keeps the fused Adam part.
        fp32 = offload_bench.OURS[kind].host_state == "fp32"
        parts = {"h2d", "d2h", "host_memory"} | ({"host_adam"} if fp32 else set())
        assert set(row["floor_parts_ms"]) == parts, kind
        assert row["profile_host_memory_gbps"] > 0
        assert row["hardware"]["host_adam_params_per_s"] > 0  # the plan's whole profile
        assert row["cost_model"] == {  # and the cost model it was planned with
            "backward_issue_factor": 4.0,
            "stream_up_fraction": 0.78,
            "stream_host_charge": 0.5,
        }
        assert len(row["issue_cost_us_reads"]) == 2
        spans = row["cpu_span_ms"]
        assert spans["calls"] == 5 and spans["backward"] > 0
        assert row["regions"] >= row["host_state_regions"] >= row["streamed_regions"] >= 0
        # Where the plan's regions' saved activations go, beside the other placements.
        moved = row["recompute_regions"] + row["host_activation_regions"]
        assert 0 <= moved <= row["regions"]


def test_the_fastest_configuration_plans_with_the_profiles_rate_of_its_kernel(
    cpu_rows: dict[str, dict[str, Any]],
) -> None:
    from offload_runtime import default_cpu_profile

    row = cpu_rows["ours_bf16m"]
    assert row["host_state_regions"] >= 1  # the 7 MiB budget moves optimizer state
    options = row["plan_options"]
    assert options["fp16_io"] and options["speculative"] and options["speculation_thread"]
    # The plan's host rate is the profile's rate of the kernel it runs.
    rate = default_cpu_profile().host_step_params_per_s("single_pass", "bf16_moments", True)
    assert row["hardware"]["host_adam_params_per_s"] == pytest.approx(rate)
    assert row["speculative_step_cost"] >= 1 and row["speculation_thread"]
    # bf16 moments: the floor's host part is the memory traffic (20 bytes a parameter),
    # not torch's fused fp32 step.
    assert row["floor_parts_ms"]["host_memory"] > 0 and row["floor_parts_ms"]["d2h"] > 0
    assert "host_adam" not in row["floor_parts_ms"]
    assert row["undone_steps"] >= 0


def test_a_bf16_master_rung_plans_with_its_own_rate_and_trains_in_bf16(
    cpu_rows: dict[str, dict[str, Any]],
) -> None:
    from offload_runtime import default_cpu_profile
    from offload_runtime.host_kernels import single_pass

    row = cpu_rows["ours_bf16_sr"]
    assert row["host_state_regions"] >= 1
    assert row["config"]["host_state"] == "bf16_stochastic"
    kernel = "single_pass" if single_pass.available() else "torch"
    assert row["plan_options"]["host_kernel"] == kernel
    assert not row["plan_options"]["fp16_io"] and not row["plan_options"]["speculative"]
    rate = default_cpu_profile().host_step_params_per_s(kernel, "bf16_stochastic")
    assert row["hardware"]["host_adam_params_per_s"] == pytest.approx(rate)
    assert row["streamed_regions"] == 0


def test_the_defaults_with_all_state_on_the_device_step_in_turn_with_full_gpu(
    cpu_rows: dict[str, dict[str, Any]],
) -> None:
    row = cpu_rows["ours"]
    assert row["host_state_regions"] == 0 and "host_rate_samples_gparam" not in row
    assert row["floor_parts_ms"] == {"h2d": 0.0, "d2h": 0.0, "host_adam": 0.0, "host_memory": 0.0}
    pair = row["paired_full_gpu"]
    assert pair["pairs"] == 5 and pair["ratio"] > 0 and pair["pair_ratio_median"] > 0


def test_the_ablation_keeps_every_regions_state_on_the_host(
    cpu_rows: dict[str, dict[str, Any]],
) -> None:
    row = cpu_rows["ablation"]
    assert row["host_state_regions"] == row["regions"] >= 1
    assert row["streamed_regions"] == 0 and "plan_streamed" not in row
    # fp32 state: a host step moves 28 bytes of host memory a parameter (every one is
    # trainable), beside the profile's fused host Adam step of each.
    parts = row["floor_parts_ms"]
    memory_s = 28 / (row["profile_host_memory_gbps"] * 1e9)
    adam_s = 1 / (row["profile_host_adam_gparam"] * 1e9)
    assert parts["host_memory"] / parts["host_adam"] == pytest.approx(memory_s / adam_s)


def test_full_gpu_steps_fp32_masters_and_narrows_them_into_the_weights(
    tiny: tuple[str, str],
) -> None:
    torch.manual_seed(0)
    full = offload_bench._full_gpu_steps(tiny[0], device="cpu")
    params = full.parameters()
    masters = full.optimizer.param_groups[0]["params"]
    assert {p.dtype for p in params} == {torch.float16}
    assert len(masters) == len(params) and {m.dtype for m in masters} == {torch.float32}
    assert all(
        torch.equal(m.detach(), p.detach().float()) for m, p in zip(masters, params, strict=True)
    )
    # One step by hand: the scaled fp16 gradients, widened and unscaled, through plain
    # fp32 Adam on copies of the masters, must give the recipe's masters.
    ref = [m.detach().clone().requires_grad_(True) for m in masters]
    ref_opt = torch.optim.Adam(ref, lr=1e-4)
    torch.manual_seed(1)  # the model's dropout: the same masks in both passes
    full.fwd_bwd()
    scale = full.loss_scale()
    assert scale == 65536.0
    for r, p in zip(ref, params, strict=True):
        assert p.grad is not None
        r.grad = p.grad.float() / scale
    ref_opt.step()
    full.zero()
    assert all(p.grad is None for p in params)
    torch.manual_seed(1)
    full.step()  # the same forward at the same weights, so the same gradients
    for m, r, p in zip(masters, ref, params, strict=True):
        torch.testing.assert_close(m.detach(), r.detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), m.detach().half())
    assert full.optimizer.state[masters[0]]["exp_avg_sq"].dtype == torch.float32


def test_a_full_gpu_row_records_its_compute_and_whether_it_trained(
    tiny: tuple[str, str],
) -> None:
    row = offload_bench._full_gpu(tiny[0], 1, 5, device="cpu")
    assert len(row["steps_ms"]) == 5 and row["step_ms"] <= row["step_mean_ms"]
    assert row["fwd_bwd_ms"] > 0
    assert offload_bench.trained(row)  # six steps at lr 1e-4 lower the loss of random data


def test_skipped_steps_and_the_steps_after_them_are_not_timed() -> None:
    clock = [0.0]
    outcomes = iter([False, True, False, False, True, False, False, False, False, False])
    last: list[bool] = [False]

    def step() -> None:
        clock[0] += 1.0
        last[0] = next(outcomes)

    untimed: list[float] = []
    times = offload_bench._timed_steps(step, 1, 3, "cpu", lambda: last[0], untimed)
    # Warm-up: False. Then: skip, after it, ok, skip, after it, ok, ok.
    assert len(times) == 3 and len(untimed) == 4


def test_cpu_spans_are_medians_in_ms_with_the_count() -> None:
    spans = {"forward": [0.010, 0.030, 0.020], "backward": [0.2, 0.1, 0.15], "step": [0.002]}
    got = cpu_span_summary(spans)
    assert got == {
        "forward": pytest.approx(20.0),
        "backward": pytest.approx(150.0),
        "step": pytest.approx(2.0),
        "calls": 3,
    }
    assert cpu_span_summary(None) is None
    assert cpu_span_summary({"forward": [], "backward": [], "step": []}) is None


class FakeHost:
    """A clock that each step advances by its cost times the host's slowness, which drifts
    step after step: what a launch-bound row sees between two rows minutes apart."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slowness = 1.0
        self.calls: list[str] = []
        self.syncs = 0

    def step(self, name: str, cost_s: float) -> Callable[[], None]:
        def run() -> None:
            self.calls.append(name)
            self.now += cost_s * self.slowness
            self.slowness *= 1.1

        return run

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.syncs += 1


def test_steps_in_turn_swap_their_order_each_pair() -> None:
    host = FakeHost()
    a, b = host.step("a", 0.040), host.step("b", 0.040)
    ta, tb = interleaved_steps(a, b, warmup=2, pairs=4, sync=host.sync, clock=host.clock)
    assert host.calls == ["a", "b"] * 2 + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(ta) == len(tb) == 4
    assert host.syncs == 1 + 8  # after the warm-up, then after every timed step


def test_equal_steps_on_a_drifting_host_pair_to_a_ratio_near_one() -> None:
    # Timed one after the other, the second would look 1.1**pairs times slower.
    host = FakeHost()
    a, b = host.step("a", 0.040), host.step("b", 0.040)
    ta, tb = interleaved_steps(a, b, warmup=0, pairs=10, sync=host.sync, clock=host.clock)
    summary = pair_summary(ta, tb)
    assert summary["pairs"] == 10
    assert summary["pair_ratio_median"] == pytest.approx(1.0, abs=0.11)
    assert 0.9 < summary["run_ratio"] < 1.1


def test_a_pair_summary_has_each_sides_step_and_the_ratios() -> None:
    s = pair_summary([0.030, 0.031, 0.032, 0.033, 0.034, 0.050], [0.030] * 6)
    assert s["ours_step_ms"] == pytest.approx(32.0)  # the mean of the 5 fastest
    assert s["peer_step_ms"] == pytest.approx(30.0)
    assert s["ratio"] == pytest.approx(32.0 / 30.0)
    assert s["run_ratio"] == pytest.approx((0.210 / 6) / 0.030)
    assert s["pair_ratio_median"] == pytest.approx((32 / 30 + 33 / 30) / 2)
    with pytest.raises(ValueError, match="pairs=0"):
        interleaved_steps(lambda: None, lambda: None, 0, 0, lambda: None)
    with pytest.raises(ValueError, match="equal, non-empty"):
        pair_summary([0.1], [])


def test_a_profile_that_read_the_host_slow_is_measured_again() -> None:
    calls: list[bool] = []

    class Profile:
        def __init__(self, gparam: float) -> None:
            self.host_adam_params_per_s = gparam * 1e9

    def profile(device: str, force: bool = False, progress: bool = True) -> Profile:
        calls.append(force)
        return Profile(4.0 if force else 2.0)

    assert reprofile_if_disturbed(2.9, profile) is None  # under 1.5x the cached 2.0
    assert calls == [False]
    again = reprofile_if_disturbed(3.5, profile)
    assert again == {"cached_gparam": 2.0, "in_process_gparam": 3.5, "now_gparam": 4.0}
    assert calls == [False, False, True]
