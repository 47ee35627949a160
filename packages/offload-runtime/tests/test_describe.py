"""What a log says of a plan: ``describe_plan`` (its options and a table of its regions),
``speculating_regions`` and ``summary_line`` (the reference's summary from the plan
alone)."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
import torch
from tiny_models import inputs, tiny_gpt2

from offload_runtime import OffloadConfig, PlanForce, default_cpu_profile, describe_plan
from offload_runtime.api import describe_options, print_summary, speculating_regions, summary_line
from offload_runtime.planning import plan_model
from offload_solver import ActivationPlacement, ParamPlacement, Plan, PlanOptions, StatePlacement

MiB = 2**20


def _plan(config: OffloadConfig, budget: int = 2**30) -> tuple[Plan, str]:
    """A plan of the tiny GPT-2 with a region per parameter group, and the summary line
    ``print_summary`` prints for it."""
    found = plan_model(
        tiny_gpt2(),
        inputs(),
        budget,
        config=config,
        hardware=default_cpu_profile(),
        device="cpu",
        progress=False,
        force=PlanForce(block_search_range_bytes=0),
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_summary(found.profile, found.plan)
    return found.plan, printed.getvalue().rstrip("\n")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_summary_line_from_the_plan_alone_is_the_one_printed(dtype: torch.dtype) -> None:
    plan, printed = _plan(OffloadConfig(dtype=dtype, fuse_gelu=False))
    assert any(rp.state is StatePlacement.DEVICE for rp in plan.regions)
    assert summary_line(plan, dtype) == printed
    assert printed.startswith("act_peak_mem=")


def _shaped(plan: Plan, shape: list[tuple[ParamPlacement, StatePlacement]]) -> Plan:
    """``plan`` with its first regions placed as ``shape`` says (the rest dropped)."""
    assert len(plan.regions) >= len(shape)
    regions = tuple(
        dataclasses.replace(rp, placement=p, state=s)
        for rp, (p, s) in zip(plan.regions, shape, strict=False)
    )
    return dataclasses.replace(plan, regions=regions)


def test_the_table_groups_regions_that_agree_and_marks_those_that_speculate() -> None:
    base, _ = _plan(OffloadConfig(dtype=torch.float32, fuse_gelu=False))
    res, sync, asyn = ParamPlacement.RESIDENT, ParamPlacement.SYNC, ParamPlacement.ASYNC
    dev, host, streamed = StatePlacement.DEVICE, StatePlacement.HOST, StatePlacement.STREAMED
    shape = [(res, dev), (res, dev), (sync, host), (asyn, host), (asyn, host), (asyn, streamed)]
    plan = _shaped(base, shape)
    r = plan.regions
    # Undo buffers for the last two host-state regions (gradients land last-first), not
    # for the one before: it and the device and streamed regions do not speculate.
    limit = r[3].region.numel + r[4].region.numel
    options = PlanOptions(speculative=True, speculative_params=limit, speculation_thread=True)
    plan = dataclasses.replace(plan, options=options)
    assert speculating_regions(plan) == {r[3].region.index, r[4].region.index}
    lines = describe_plan(plan).splitlines()
    assert lines[0] == f"plan: {describe_options(plan)}"
    assert lines[1].startswith("  regions    param MB  parameters")
    assert lines[1].endswith("optimizer state  speculative  activations")

    def mb(*i: int) -> str:
        return f"{sum(r[k].region.size_bytes for k in i) / MiB:.3f}"

    assert [line.split() for line in lines[2:]] == [
        ["0-1", mb(0, 1), "resident", "device", "-", "keep"],
        ["2", mb(2), "offloaded", "(sync)", "host", "no", "keep"],
        ["3-4", mb(3, 4), "offloaded", "(async)", "host", "yes", "keep"],
        ["5", mb(5), "offloaded", "(async)", "streamed", "-", "keep"],
    ]
    assert (
        f"speculative host steps (undo buffers for {limit} parameters, 1.00x a plain step, "
        "own thread)" in lines[0]
    )
    assert "streamed state in 1 regions (staged in backward)" in lines[0]
    # Without a limit every host-state region speculates; without speculation none does.
    unlimited = dataclasses.replace(plan, options=PlanOptions(speculative=True))
    assert speculating_regions(unlimited) == {r[k].region.index for k in (2, 3, 4)}
    assert "undo buffers for all host-state parameters" in describe_options(unlimited)
    plain = dataclasses.replace(plan, options=PlanOptions(host_step_after_backward=True))
    assert speculating_regions(plain) == frozenset()
    assert [line.split()[-2] for line in describe_plan(plain).splitlines()[2:]] == [
        "-",
        "no",
        "no",
        "-",
    ]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (
            PlanOptions(),
            "torch host kernel, conversions on the host, host steps under backward, "
            "no streamed state, late host work",
        ),
        (
            PlanOptions(
                host_kernel="single_pass",
                fp16_io=True,
                speculative=True,
                speculative_step_cost=1.15,
                micro_batches=2,
            ),
            "single_pass host kernel, fp16 I/O, conversions on the host, speculative host "
            "steps (undo buffers for all host-state parameters, 1.15x a plain step), no "
            "streamed state, late host work, 2 micro-batches per step",
        ),
        (
            PlanOptions(
                convert_on_device=True,
                host_step_after_backward=True,
                state_on_device=False,
                late_host_work=False,
            ),
            "torch host kernel, conversions on the device, host steps after backward, no "
            "streamed state, all optimizer state on the host, no late host work",
        ),
        (
            PlanOptions(overlap=False, host_step_after_backward=True),
            "torch host kernel, conversions on the host, host steps after backward, waited "
            "for, no streamed state, late host work",
        ),
    ],
)
def test_the_options_line_names_each_choice(options: PlanOptions, words: str) -> None:
    base, _ = _plan(OffloadConfig(dtype=torch.float32, fuse_gelu=False))
    assert describe_options(dataclasses.replace(base, options=options)) == words


def test_the_table_and_the_plan_line_say_what_each_region_does_with_its_activations() -> None:
    base, _ = _plan(OffloadConfig(dtype=torch.float32, fuse_gelu=False))
    modes = [ActivationPlacement.KEEP, ActivationPlacement.RECOMPUTE, ActivationPlacement.HOST]
    regions = tuple(
        dataclasses.replace(rp, activations=modes[min(i, 2)]) for i, rp in enumerate(base.regions)
    )
    plan = dataclasses.replace(base, regions=regions)
    lines = describe_plan(plan).splitlines()
    assert [line.split()[-1] for line in lines[2:]][:3] == ["keep", "recompute", "host"]
    hosted = len(regions) - 2
    assert f"activations recomputed in 1 regions (1 runs), sent to the host in {hosted}" in lines[0]
    assert "activations" not in describe_options(base)
