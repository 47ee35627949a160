"""A plan records the speed-only choices it was made with (``Plan.options``): those
``solve`` was given, read back from JSON, and defaults for a plan written without them."""

from __future__ import annotations

import dataclasses
import json

import pytest
from solver_helpers import chain, flat_hardware

from offload_solver import ActivationPlacement, ParamPlacement, Plan, PlanOptions, solve


def _plan(**kwargs: object) -> Plan:
    profile = chain([200, 300, 150, 250], fwd_flop=100, bwd_flop=400)
    hardware = flat_hardware(h2d_bytes_per_s=100.0, flop_per_s=100.0)
    return solve(profile, hardware, 5200, **kwargs)  # type: ignore[arg-type]


def test_solve_records_the_choices_it_was_given() -> None:
    plan = _plan(
        host_step_after_backward=False,
        speculative_params=300,
        speculative_step_cost=1.5,
        speculation_thread=True,
        state_on_device=False,
        late_host_work=False,
        micro_batches=2,
    )
    assert plan.options == PlanOptions(
        speculative_params=300,
        speculative_step_cost=1.5,
        speculation_thread=True,
        state_on_device=False,
        late_host_work=False,
        micro_batches=2,
    )
    assert _plan(host_step_after_backward=True).options.host_step_after_backward


def test_options_read_back_from_json_and_an_older_plan_reads_the_defaults() -> None:
    plan = dataclasses.replace(
        _plan(),
        options=PlanOptions(
            host_kernel="single_pass",
            fp16_io=True,
            speculative=True,
            speculative_params=None,
            speculative_step_cost=1.15,
            speculation_thread=True,
            micro_batches=3,
        ),
    )
    doc = json.loads(plan.to_json())
    assert doc["options"]["host_kernel"] == "single_pass"
    assert doc["options"]["speculative_params"] is None
    assert Plan.from_json(plan.to_json()) == plan
    del doc["options"]  # a plan written before plans recorded their options
    assert Plan.from_json(json.dumps(doc)).options == PlanOptions()
    doc["options"] = {"host_kernel": "cuda"}
    with pytest.raises(ValueError, match="host_kernel is 'cuda'"):
        Plan.from_json(json.dumps(doc))
    doc["options"] = {"host_kernel": "torch", "fast": True}
    with pytest.raises(ValueError, match=r"unknown keys \['fast'\]"):
        Plan.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_kernel": "numba"}, "host_kernel is 'numba'"),
        ({"fp16_io": True}, "host_kernel='single_pass'"),
        ({"fp16_io": True, "host_kernel": "single_pass", "convert_on_device": True}, "fp16_io"),
        ({"speculative": True, "host_step_after_backward": True}, "host_step_after_backward"),
        ({"speculative_params": -1}, "speculative_params is -1"),
        ({"speculative_step_cost": 0.5}, "speculative_step_cost is 0.5"),
        ({"micro_batches": 0}, "micro_batches is 0"),
    ],
)
def test_contradictory_or_bad_options_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlanOptions(**kwargs)  # type: ignore[arg-type]


def _with_activations(plan: Plan, modes: list[ActivationPlacement]) -> Plan:
    """``plan`` with ``modes``, each region that a later one is recomputed with resident."""
    chained = ActivationPlacement.RECOMPUTE_WITH_PREVIOUS
    return dataclasses.replace(
        plan,
        regions=tuple(
            dataclasses.replace(
                rp,
                activations=modes[i],
                placement=ParamPlacement.RESIDENT
                if i + 1 < len(modes) and modes[i + 1] is chained
                else rp.placement,
                prefetch_at=None
                if i + 1 < len(modes) and modes[i + 1] is chained
                else rp.prefetch_at,
            )
            for i, rp in enumerate(plan.regions)
        ),
    )


def test_a_region_is_recomputed_with_a_recomputed_resident_region_before_it() -> None:
    plan = _plan()
    n = len(plan.regions)
    keep, host = ActivationPlacement.KEEP, ActivationPlacement.HOST
    recompute = ActivationPlacement.RECOMPUTE
    chained = ActivationPlacement.RECOMPUTE_WITH_PREVIOUS
    ok = _with_activations(plan, [recompute, chained, chained] + [keep] * (n - 3))
    assert Plan.from_json(ok.to_json()) == ok
    with pytest.raises(ValueError, match="region 0 is recompute_with_previous"):
        _with_activations(plan, [chained] + [keep] * (n - 1))
    with pytest.raises(
        ValueError, match="region 1 is recompute_with_previous, but region 0 is not"
    ):
        _with_activations(plan, [host, chained] + [keep] * (n - 2))
    regions = list(ok.regions)
    regions[1] = dataclasses.replace(regions[1], placement=ParamPlacement.SYNC)
    with pytest.raises(ValueError, match="every region of a recomputed run but the last"):
        dataclasses.replace(ok, regions=tuple(regions))


def test_region_activations_read_back_from_json_and_default_to_keep() -> None:
    plan = _plan()
    assert all(rp.activations is ActivationPlacement.KEEP for rp in plan.regions)
    choices = [
        ActivationPlacement.KEEP,
        ActivationPlacement.HOST,
        ActivationPlacement.RECOMPUTE,
        ActivationPlacement.RECOMPUTE_WITH_PREVIOUS,
    ]
    assert set(choices) == set(ActivationPlacement)
    marked = _with_activations(plan, [choices[i % 4] for i in range(len(plan.regions))])
    doc = json.loads(marked.to_json())
    assert [rp["activations"] for rp in doc["regions"][:4]] == [
        "keep",
        "host",
        "recompute",
        "recompute_with_previous",
    ]
    assert Plan.from_json(marked.to_json()) == marked
    for rp in doc["regions"]:  # a plan written before regions recorded their activations
        del rp["activations"]
    assert Plan.from_json(json.dumps(doc)) == plan
    doc["regions"][0]["activations"] = "disk"
    with pytest.raises(ValueError, match=r"regions\[0\]\.activations is 'disk'"):
        Plan.from_json(json.dumps(doc))
