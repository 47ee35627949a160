"""Frozen parameters (``Parameter.trainable=False``): priced as parameters, never as
optimizer work."""

from __future__ import annotations

import json

import pytest
from solver_helpers import flat_hardware

from offload_solver import (
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    build_regions,
    get_simulator,
    solve,
)

R, A = ParamPlacement.RESIDENT, ParamPlacement.ASYNC
HOST, DEVICE = StatePlacement.HOST, StatePlacement.DEVICE


def layers(frozen: set[int], n: int = 4) -> ModelProfile:
    """``n`` layers of 100 parameters (200 B); those in ``frozen`` do not train."""
    params = tuple(Parameter(f"w{i}", 100, 200, trainable=i not in frozen) for i in range(n))
    ops = tuple(
        Operation(f"mm{i}", (f"w{i}",), saved_bytes=10, fwd_flop=1000, bwd_flop=2000)
        for i in range(n)
    )
    return ModelProfile("layers", params, ops)


def test_json_round_trip_and_older_json_reads_trainable() -> None:
    profile = layers({0, 2})
    assert ModelProfile.from_json(profile.to_json()) == profile
    data = json.loads(profile.to_json())
    for p in data["parameters"]:
        del p["trainable"]
    old = ModelProfile.from_json(json.dumps(data))
    assert all(p.trainable for p in old.parameters)
    assert old.trainable_param_numel == old.total_param_numel == 400
    assert profile.trainable_param_numel == 200


def test_validation_names_trainable_and_tied_groups_agree() -> None:
    data = json.loads(layers(set()).to_json())
    data["parameters"][0]["trainable"] = 1
    with pytest.raises(ValueError, match="trainable"):
        ModelProfile.from_json(json.dumps(data))
    params = (Parameter("a", 100, 200), Parameter("b", 100, 200, trainable=False))
    with pytest.raises(ValueError, match="mixes trainable and frozen"):
        ModelProfile(
            "tied", params, (Operation("op", ("a", "b"), fwd_flop=1),), tied_groups=(("a", "b"),)
        )


def test_regions_count_trainable_elements_and_plans_keep_them() -> None:
    layout = build_regions(layers({1, 2, 3}), range_bytes=0)
    assert [r.numel for r in layout.regions] == [100] * 4
    assert [r.trainable_numel for r in layout.regions] == [100, 0, 0, 0]
    assert [r.trainable_size_bytes for r in layout.regions] == [200, 0, 0, 0]
    merged = build_regions(layers({1, 2, 3}), range_bytes=2**20).regions
    assert sum(r.stepped_numel for r in merged) == 100
    plan = solve(layers({1, 2, 3}), flat_hardware(), 10**6, block_search_range_bytes=0)
    again = Plan.from_json(plan.to_json())
    assert [rp.region for rp in again.regions] == [rp.region for rp in plan.regions]
    data = json.loads(plan.to_json())
    for rp in data["regions"]:
        del rp["region"]["trainable_numel"]
        del rp["region"]["trainable_size_bytes"]
    old = Plan.from_json(json.dumps(data))
    assert [rp.region.stepped_numel for rp in old.regions] == [100] * 4


def test_a_frozen_region_has_no_state_gradient_copy_or_step() -> None:
    profile = layers({1})
    ctx = SimulationContext.build(profile, flat_hardware(), block_search_range_bytes=0)
    assert ctx.state_bytes[1] == 0 and ctx.host_step_s[1] == 0.0 and ctx.grad_d2h_s[1] == 0.0
    assert ctx.state_bytes[0] == 100 * profile.device_state_bytes_per_param
    asg = [
        RegionAssignment(R, HOST),
        RegionAssignment(A, HOST, 2),
        RegionAssignment(R, DEVICE),
        RegionAssignment(R, HOST),
    ]
    res = get_simulator("async").simulate(ctx, asg)
    work = {(iv.region, iv.kind) for iv in res.timeline}
    assert (0, "host_step") in work and (0, "grad_offload") in work
    assert not {k for r, k in work if r == 1} & {"host_step", "grad_offload", "param_upload"}
    all_trainable = get_simulator("async").simulate(
        SimulationContext.build(layers(set()), flat_hardware(), block_search_range_bytes=0), asg
    )
    assert (1, "host_step") in {(iv.region, iv.kind) for iv in all_trainable.timeline}
    assert res.peak_bytes <= all_trainable.peak_bytes
    # A device-state region without trainable parameters holds no state.
    frozen_device = [RegionAssignment(R, DEVICE)] * 4
    ctx_all = SimulationContext.build(layers({0, 1, 2, 3}), flat_hardware())
    res = get_simulator("sync").simulate(ctx_all, frozen_device[: ctx_all.num_regions])
    assert res.static_bytes == 800
    assert not [iv for iv in res.timeline if iv.kind in ("device_step", "host_step")]


def test_frozen_profile_plans_less_state_and_a_shorter_step_at_one_budget() -> None:
    hw = flat_hardware(host_adam_params_per_s=100.0)
    trainable, frozen = layers(set(), n=6), layers({0, 1, 2, 4, 5}, n=6)
    roomy = 10**6
    p_all = solve(trainable, hw, roomy, block_search_range_bytes=0)
    p_frozen = solve(frozen, hw, roomy, block_search_range_bytes=0)
    assert p_frozen.predicted_peak_bytes < p_all.predicted_peak_bytes
    # A budget that holds every parameter but not every layer's device state.
    budget = 2500
    p_all = solve(trainable, hw, budget, block_search_range_bytes=0)
    p_frozen = solve(frozen, hw, budget, block_search_range_bytes=0)
    assert p_frozen.predicted_step_time_s < p_all.predicted_step_time_s
    assert p_frozen.predicted_peak_bytes <= p_all.predicted_peak_bytes
