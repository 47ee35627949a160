"""The planner: what it chooses per training precision, what the plan records, the user's
configuration and the choices a test or an expert forces (``PlanForce``)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import pytest
import torch
from tiny_models import forcing_budget, inputs, least_budget, tiny_gpt2

import offload_runtime.planning.planner as planner
from offload_runtime import (
    OffloadConfig,
    PlanForce,
    default_cpu_profile,
    memory_optimize,
    plan,
)
from offload_runtime.host_kernels import single_pass
from offload_runtime.planning import (
    SPECULATION_HOST_SHARE,
    Candidate,
    build_offload_module,
    candidates,
    measure_device_bytes_in_use,
    plan_model,
    speculative_params_that_fit,
)
from offload_runtime.planning.candidates import planning_hardware
from offload_runtime.planning.device import model_bytes_on
from offload_runtime.planning.planner import BLOCK_SEARCH_MODEL_SHARE, block_search_range
from offload_runtime.planning.speculation import host_state_bytes
from offload_solver import CostModel, InfeasibleBudgetError, PlanOptions, StatePlacement
from offload_solver.regions import BLOCK_SEARCH_RANGE_BYTES

FP32 = OffloadConfig(dtype=torch.float32, fuse_gelu=False)


@pytest.fixture
def trace_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner traces each model object once per test (per dtype, target and GELU
    fusion): for tests of planning arguments, which plan one model many times."""
    real = planner.trace
    traced: dict[tuple[Any, ...], Any] = {}

    def trace(model: torch.nn.Module, example: Any, **kwargs: Any) -> Any:
        shapes = tuple((k, tuple(v.shape)) for k, v in dict(example).items())
        key = (id(model), shapes, *sorted(kwargs.items(), key=str))
        if key not in traced:
            traced[key] = real(model, example, **kwargs)
        return traced[key]

    monkeypatch.setattr(planner, "trace", trace)


def planned(
    model: torch.nn.Module,
    budget: int = 2**30,
    config: OffloadConfig = FP32,
    solver: str = "asyn",
    **force: Any,
) -> planner.PlannedModel:
    """``model`` planned on the CPU's default profile with ``force``'s fields fixed."""
    return plan_model(
        model,
        inputs(),
        budget,
        solver,
        config=config,
        hardware=default_cpu_profile(),
        device="cpu",
        progress=False,
        force=PlanForce(**force),
    )


# ---- what the planner chooses -----------------------------------------------------------


@pytest.mark.skipif(not single_pass.available(), reason="numba cannot load here")
def test_the_candidates_per_precision_where_numba_loads() -> None:
    """fp16: fp16 I/O (where it compiles) with speculation, against the three-pass route
    converting on the device; bf16: conversions on the host and the device; fp32: one. The
    kernel without fp16 I/O or speculation is the single-pass one for bf16 moments only."""
    io = single_pass.fp16_io_available()
    fp16 = OffloadConfig()
    assert candidates(fp16, PlanForce()) == [
        Candidate("single_pass", io, False, True),
        Candidate("torch", False, True, False),
    ]
    bf16m = OffloadConfig(host_state="bf16_moments")
    assert candidates(bf16m, PlanForce())[1] == Candidate("single_pass", False, True, False)
    bf16 = OffloadConfig(dtype=torch.bfloat16)
    assert candidates(bf16, PlanForce()) == [
        Candidate("torch", False, False, False),
        Candidate("torch", False, True, False),
    ]
    assert candidates(FP32, PlanForce()) == [Candidate("torch", False, False, False)]
    # Forced values apply to every candidate; duplicates are solved once.
    assert candidates(fp16, PlanForce(convert_on_device=False, speculative=False)) == [
        Candidate("single_pass", io, False, False),
        Candidate("torch", False, False, False),
    ]
    assert candidates(fp16, PlanForce(host_kernel="torch", convert_on_device=False)) == [
        Candidate("torch", False, False, True),
        Candidate("torch", False, False, False),
    ]
    assert candidates(fp16, PlanForce(overlap=False, convert_on_device=True)) == [
        Candidate("single_pass", False, True, False),
        Candidate("torch", False, True, False),
    ]


def test_without_numba_the_planner_warns_once_and_plans_torchs_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(single_pass, "available", lambda: False)
    monkeypatch.setattr(single_pass, "_warned", type(single_pass._warned)())
    with pytest.warns(RuntimeWarning, match="numba cannot be imported.*pip install numba"):
        found = candidates(OffloadConfig(), PlanForce())
    assert found == [
        Candidate("torch", False, False, False),
        Candidate("torch", False, True, False),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        candidates(OffloadConfig(dtype=torch.bfloat16, host_state="bf16_moments"), PlanForce())
        candidates(FP32, PlanForce())
    with pytest.raises(ImportError, match="pip install numba"):
        candidates(OffloadConfig(), PlanForce(host_kernel="single_pass"))


def test_forcing_what_fp16_alone_has_is_a_named_error() -> None:
    for force in (PlanForce(fp16_io=True), PlanForce(speculative=True)):
        with pytest.raises(ValueError, match=r"OffloadConfig\(dtype=torch.float16\)"):
            candidates(FP32, force)


@pytest.mark.usefixtures("trace_once")
@pytest.mark.skipif(not single_pass.available(), reason="numba cannot load here")
def test_an_fp16_plan_records_the_kernel_and_speculation_it_was_priced_with() -> None:
    model = tiny_gpt2()
    chosen = planned(model, config=OffloadConfig(), state_on_device=False)
    options = chosen.plan.options
    assert len(chosen.predictions_s) == 2
    if options.speculative:
        assert options.host_kernel == "single_pass" and not options.convert_on_device
        assert options.speculation_thread and not options.host_step_after_backward
        # The default profile's ratio: a speculative single-pass step 1.15x a plain one.
        assert options.speculative_step_cost == pytest.approx(1.15)
    else:
        assert options.convert_on_device and options.host_step_after_backward
    # Each candidate forced: its own options, and the planner kept the faster.
    spec = planned(model, config=OffloadConfig(), state_on_device=False, speculative=True)
    plain = planned(model, config=OffloadConfig(), state_on_device=False, speculative=False)
    for p in (spec, plain):
        assert p.plan.options.speculative is (p is spec)
    best = min(p.plan.predicted_step_time_s for p in (spec, plain))
    assert chosen.plan.predicted_step_time_s == pytest.approx(best)


@pytest.mark.usefixtures("trace_once")
def test_plan_is_the_plan_memory_optimize_builds_and_the_module_keeps_the_config() -> None:
    model, inp, hw = tiny_gpt2(), inputs(), default_cpu_profile()
    config = OffloadConfig(dtype=torch.float32, accumulation_steps=2)
    alone = plan(model, inp, 2**20, config=config, hardware=hw, device="cpu", progress=False)
    module = memory_optimize(
        model, inp, 2**20, config=config, hardware=hw, device="cpu", progress=False
    )
    assert module.config == config
    assert module.plan.options == alone.options
    assert module.plan.options.micro_batches == 2
    assert [(r.placement, r.state) for r in module.plan.regions] == [
        (r.placement, r.state) for r in alone.regions
    ]
    assert module.plan.predicted_step_time_s == pytest.approx(alone.predicted_step_time_s)
    assert len(inspect.signature(memory_optimize).parameters) == 8
    assert list(inspect.signature(plan).parameters) == list(
        inspect.signature(memory_optimize).parameters
    )
    module.close()


def test_a_meta_model_is_planned_and_only_building_needs_weights() -> None:
    with torch.device("meta"):
        meta_model = tiny_gpt2()
    found = planned(meta_model)
    assert found.plan.regions
    with pytest.raises(ValueError, match="meta device"):
        build_offload_module(meta_model, found)


def test_a_gpu_is_planned_for_without_one_given_its_profile() -> None:
    if torch.cuda.is_available():
        pytest.skip("plans for the GPU present instead")
    from offload_solver import default_hardware

    with torch.device("meta"):
        meta_model = tiny_gpt2()
    found = plan_model(
        meta_model,
        inputs(),
        2**30,
        config=FP32,
        hardware=default_hardware(),
        device="cuda",
        progress=False,
    )
    assert found.device.type == "cuda" and found.traced.target_device.type == "cuda"
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        plan_model(meta_model, inputs(), 2**30, config=FP32, device="cuda", progress=False)


# ---- granularity, speculation limits, host rates ----------------------------------------


def test_the_block_search_range_is_the_references_from_gpt2_medium_up() -> None:
    """At most a quarter of the model's parameter bytes, at most the reference's 128 MiB:
    gpt2_medium (355 M parameters, 710 MB in fp16) keeps 128 MiB; a tiny model gets
    regions of its own size scale."""
    profile = planned(tiny_gpt2()).profile
    assert block_search_range(profile, PlanForce()) == (
        profile.total_param_bytes // BLOCK_SEARCH_MODEL_SHARE
    )
    assert 0 < block_search_range(profile, PlanForce()) < BLOCK_SEARCH_RANGE_BYTES
    assert 355_000_000 * 2 // BLOCK_SEARCH_MODEL_SHARE > BLOCK_SEARCH_RANGE_BYTES
    assert block_search_range(profile, PlanForce(block_search_range_bytes=7)) == 7


def test_undo_buffers_take_the_regions_whose_gradients_land_first_within_host_memory() -> None:
    model = tiny_gpt2()
    found = planned(model, state_on_device=False, block_search_range_bytes=0).plan
    host = [rp.region for rp in found.regions if rp.state is StatePlacement.HOST]
    assert len(host) > 2
    f32 = torch.float32
    total = sum(r.numel for r in host)
    state = host_state_bytes(found, f32, f32)
    # fp32 master, gradient and moments, the fp32 staging, an offloaded region's upload copy
    assert total * 20 <= state <= total * 24
    assert speculative_params_that_fit(found, f32, f32, None) is None
    assert speculative_params_that_fit(found, f32, f32, 10 * (state + 12 * total)) is None
    # Room for the last region's undo buffers (12 bytes a parameter) and not the next's.
    last, before = host[-1], host[-2]
    room = (12 * last.numel + 6 * before.numel) / SPECULATION_HOST_SHARE
    assert speculative_params_that_fit(found, f32, f32, int(state + room)) == last.numel
    assert speculative_params_that_fit(found, f32, f32, state) == 0


@pytest.mark.usefixtures("trace_once")
@pytest.mark.skipif(not single_pass.available(), reason="numba cannot load here")
def test_host_memory_in_the_config_bounds_the_parameters_that_speculate() -> None:
    model = tiny_gpt2()
    config = OffloadConfig(host_memory_bytes=1)
    force: dict[str, Any] = {"state_on_device": False, "block_search_range_bytes": 0}
    found = planned(model, config=config, speculative=True, **force)
    assert found.plan.options.speculative
    assert found.plan.options.speculative_params == 0
    roomy = planned(model, config=OffloadConfig(host_memory_bytes=2**40), **force)
    assert roomy.plan.options.speculative_params is None
    forced = planned(model, config=config, speculative=True, speculative_params=5, **force)
    assert forced.plan.options.speculative_params == 5


@pytest.mark.usefixtures("trace_once")
@pytest.mark.skipif(not single_pass.available(), reason="numba cannot load here")
def test_the_models_own_host_weights_count_as_free_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host memory that bounds speculation is what is available plus the model's own
    weights in host memory (the module's storage replaces them, as on the device): a
    model planned on meta where its weights would be free, and the same model with host
    weights taking that memory, get the same plan."""
    model = tiny_gpt2()
    with torch.device("meta"):
        meta_model = tiny_gpt2()
    own = model_bytes_on(model, torch.device("cpu"))
    assert own == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    assert model_bytes_on(meta_model, torch.device("cpu")) == 0
    force: dict[str, Any] = {"speculative": True, "state_on_device": False}
    force["block_search_range_bytes"] = 0
    config = OffloadConfig(fuse_gelu=False)
    roomy = planned(meta_model, config=config, **force).plan
    host = [rp.region for rp in roomy.regions if rp.state is StatePlacement.HOST]
    assert len(host) > 2
    # Room for the undo buffers of the last host-state region only, beside the host state.
    state = host_state_bytes(roomy, torch.float32, torch.float16)
    room = state + int(12 * host[-1].numel / SPECULATION_HOST_SHARE) + 1
    monkeypatch.setattr(planner, "available_host_memory_bytes", lambda: room)
    assert planner.host_bytes_available(meta_model) == room
    on_meta = planned(meta_model, config=config, **force).plan
    monkeypatch.setattr(planner, "available_host_memory_bytes", lambda: room - own)
    assert planner.host_bytes_available(model) == room
    on_host = planned(model, config=config, **force).plan
    assert on_meta.options.speculative_params == host[-1].numel
    assert on_host.options == on_meta.options and on_host.regions == on_meta.regions
    monkeypatch.setattr(planner, "available_host_memory_bytes", lambda: 0)
    assert planner.host_bytes_available(model) is None  # unknown: no limit planned


def test_each_candidate_is_priced_at_its_own_kernels_rate() -> None:
    hw = default_cpu_profile()
    fp16 = OffloadConfig()
    io = Candidate("single_pass", True, False, True)
    priced, cost = planning_hardware(io, fp16, hw, PlanForce())
    assert priced.host_adam_params_per_s == hw.host_step_params_per_s("single_pass", "fp32", True)
    assert priced.host_convert_elems_per_s == 0.0  # conversions inside the host step
    assert cost == pytest.approx(1.15)
    plain = Candidate("torch", False, True, False)
    priced, cost = planning_hardware(plain, fp16, hw, PlanForce())
    assert priced == hw and cost == 1.0
    told, _ = planning_hardware(plain, fp16, hw, PlanForce(host_step_params_per_s=123.0))
    assert told.host_adam_params_per_s == 123.0


# ---- forced choices and what they change --------------------------------------------------


@pytest.mark.usefixtures("trace_once")
def test_the_cost_model_forced_is_planned_with_and_recorded() -> None:
    # All optimizer state on the host and an issue cost of 20 us an operation: the
    # backward beside the host issues at CostModel()'s factor unless another is forced.
    model = tiny_gpt2()
    hw = dataclasses.replace(default_cpu_profile(), op_overhead_s=20e-6)

    def with_model(cost_model: CostModel | None) -> planner.PlannedModel:
        return plan_model(
            model,
            inputs(),
            2**30,
            config=FP32,
            hardware=hw,
            device="cpu",
            progress=False,
            force=PlanForce(state_on_device=False, cost_model=cost_model),
        )

    fitted, unfitted = with_model(None), with_model(CostModel(backward_issue_factor=1.0))
    assert fitted.plan.cost_model == CostModel()
    assert unfitted.plan.cost_model == CostModel(backward_issue_factor=1.0)
    assert unfitted.plan.predicted_step_time_s < fitted.plan.predicted_step_time_s
    with pytest.raises(ValueError, match=r"PlanForce\.cost_model"):
        PlanForce(cost_model={"backward_issue_factor": 1.0})  # type: ignore[arg-type]


@pytest.mark.usefixtures("trace_once")
def test_a_slower_host_rate_forced_is_planned_for() -> None:
    model = tiny_gpt2()
    fast = planned(model, state_on_device=False)
    rate = default_cpu_profile().host_adam_params_per_s / 10
    slow = planned(model, state_on_device=False, host_step_params_per_s=rate)
    assert slow.plan.predicted_step_time_s > fast.plan.predicted_step_time_s
    assert slow.hardware.host_adam_params_per_s == rate  # what the module reports
    with pytest.raises(ValueError, match="host_step_params_per_s"):
        PlanForce(host_step_params_per_s=0.0)
    with pytest.raises(ValueError, match="speculative_params"):
        PlanForce(speculative_params=-1)


@pytest.mark.parametrize(
    ("config", "force", "thread"),
    [
        (OffloadConfig(), {"speculative": True}, True),  # fp16 speculating: its own thread
        (OffloadConfig(), {"speculative": True, "speculation_thread": False}, False),
        (OffloadConfig(), {"speculative": False}, False),  # fp16 waits for the answer
        (OffloadConfig(dtype=torch.bfloat16), {}, False),  # bf16 hooks step in place
    ],
)
def test_the_plan_says_whether_speculative_steps_have_their_own_thread(
    config: OffloadConfig, force: dict[str, Any], thread: bool
) -> None:
    if force.get("speculative") and not single_pass.available():
        force["host_kernel"] = "torch"
    found = planned(tiny_gpt2(), config=config, convert_on_device=False, **force)
    assert found.plan.options.speculation_thread is thread
    assert found.plan.options.speculative is bool(force.get("speculative"))


@pytest.mark.usefixtures("trace_once")
def test_device_bytes_in_use_come_off_the_budget_and_micro_batches_are_priced() -> None:
    # On the CPU nothing is measured in use; bytes forced are planned around and counted in
    # the predicted peak, and a budget they leave too little of names the least one.
    model = tiny_gpt2()
    assert measure_device_bytes_in_use(torch.device("cpu"), model) == 0
    plain = planned(model)
    shifted = planned(model, device_bytes_in_use=4096)
    assert shifted.plan.predicted_peak_bytes == plain.plan.predicted_peak_bytes + 4096
    with pytest.raises(InfeasibleBudgetError) as info:
        planned(model, device_bytes_in_use=2**30)
    assert info.value.least_budget_bytes > 2**30
    # Accumulating over micro-batches: the predicted step covers them all.
    accumulating = planned(model, config=dataclasses.replace(FP32, accumulation_steps=3))
    assert accumulating.plan.options.micro_batches == 3
    assert accumulating.plan.predicted_step_time_s > 2 * plain.plan.predicted_step_time_s


def test_streaming_is_offered_unless_forced_off() -> None:
    """The planner offers the solver streamed costs sized to the budget; a host-bound
    profile streams some regions and records the costs; ``PlanForce(streamed=False)``
    streams none."""
    hw = dataclasses.replace(default_cpu_profile(), host_adam_params_per_s=1e5)
    model = tiny_gpt2()

    def plan_on(**force: Any) -> planner.PlannedModel:
        return plan_model(
            model,
            inputs(),
            64 << 20,
            config=FP32,
            hardware=hw,
            device="cpu",
            progress=False,
            force=PlanForce(state_on_device=False, block_search_range_bytes=0, **force),
        )

    streams = plan_on().plan
    assert any(rp.state is StatePlacement.STREAMED for rp in streams.regions)
    assert streams.streamed is not None and streams.streamed.staged_chunks > 0
    off = plan_on(streamed=False).plan
    assert all(rp.state is not StatePlacement.STREAMED for rp in off.regions)
    unstaged = plan_on(stage_in_backward=False).plan
    assert unstaged.streamed is not None and unstaged.streamed.staged_chunks == 0
    assert not unstaged.options.stage_in_backward


# ---- the configuration, and bad inputs ----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.float64}, "OffloadConfig.dtype"),
        ({"host_state": "fp16"}, "OffloadConfig.host_state"),
        ({"host_memory_bytes": 0}, "OffloadConfig.host_memory_bytes"),
        ({"host_threads": -2}, "OffloadConfig.host_threads"),
        ({"accumulation_steps": 0}, "OffloadConfig.accumulation_steps"),
        ({"fuse_gelu": 1}, "OffloadConfig.fuse_gelu"),
    ],
)
def test_a_bad_config_is_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_kernel": "numba"}, "PlanForce.host_kernel"),
        ({"fp16_io": True, "host_kernel": "torch"}, "single-pass"),
        ({"fp16_io": True, "convert_on_device": True}, "converts on the host"),
        ({"speculative": True, "overlap": False}, "needs overlap"),
        ({"block_search_range_bytes": -1}, "block_search_range_bytes"),
        ({"device_bytes_in_use": 1.5}, "device_bytes_in_use"),
    ],
)
def test_contradictory_or_bad_forced_choices_are_named(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlanForce(**kwargs)


def test_bad_inputs_get_named_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_gpt2()
    inp = inputs()
    kwargs: dict[str, Any] = {"config": FP32, "device": "cpu", "progress": False}
    with pytest.raises(ValueError, match="memory_budget"):
        memory_optimize(model, inp, 0, "syn", **kwargs)
    with pytest.raises(ValueError, match="config must be an OffloadConfig"):
        memory_optimize(model, inp, 2**30, "syn", config=torch.float32, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not registered"):
        memory_optimize(model, inp, 2**30, "nope", **kwargs)
    with pytest.raises(InfeasibleBudgetError) as info:
        memory_optimize(model, inp, 1000, "syn", **kwargs)
    assert str(info.value.least_budget_bytes) in str(info.value).replace(",", "")
    with torch.device("meta"):
        meta_model = tiny_gpt2()
    with pytest.raises(ValueError, match="meta"):
        memory_optimize(meta_model, inp, 2**30, "syn", **kwargs)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            memory_optimize(model, inp, 2**30, "syn", device="cuda", progress=False)
    import offload_runtime.storage as storage

    monkeypatch.setattr(storage, "available_host_memory_bytes", lambda: 1)
    least = least_budget(model, inp, "syn", torch.float32, default_cpu_profile())
    with pytest.raises(RuntimeError, match="host memory too small"):
        build_offload_module(model, planned(model, least, solver="syn", block_search_range_bytes=0))


def test_a_plan_by_hand_runs_with_the_default_options_and_a_config_of_its_dtype() -> None:
    """A module built from a plan whose options were never set executes ``PlanOptions()``
    and keeps ``OffloadConfig(dtype=...)``; a config of another dtype is refused."""
    model = tiny_gpt2()
    budget = forcing_budget(model, inputs(), "asyn", torch.float32, default_cpu_profile())
    found = planned(model, budget, block_search_range_bytes=0)
    bare = dataclasses.replace(found, plan=dataclasses.replace(found.plan, options=PlanOptions()))
    module = build_offload_module(model, bare)
    assert module.config == FP32 and not module.convert_on_device
    module.close()
    with pytest.raises(ValueError, match=r"OffloadConfig says torch\.float16"):
        build_offload_module(model, dataclasses.replace(found, config=OffloadConfig()))


@pytest.mark.parametrize("state", ["bf16_stochastic", "bf16_8bit", "bf16_nearest"])
def test_a_bf16_master_rung_is_one_candidate_at_its_own_rate(state: str) -> None:
    """A bf16 master is its own upload copy: one candidate, conversions on the host (none
    to make: no conversion pass is priced), the rung's measured host rate, and no
    streamed state (the ring steps fp32 masters)."""
    config = OffloadConfig(dtype=torch.bfloat16, host_state=state)
    kernel = "single_pass" if single_pass.available() else "torch"
    found = candidates(config, PlanForce())
    assert found == [Candidate(kernel, False, False, False)]
    with pytest.raises(ValueError, match="keeps bf16 ones"):
        candidates(config, PlanForce(convert_on_device=True))
    hw = default_cpu_profile()
    priced, _ = planning_hardware(found[0], config, hw, PlanForce())
    assert priced.host_adam_params_per_s == hw.host_step_params_per_s(kernel, state)
    assert priced.host_convert_elems_per_s == 0.0
    model = tiny_gpt2()
    budget = forcing_budget(model, inputs(), "asyn", torch.bfloat16, hw)
    plan = planned(model, budget, config=config).plan
    states = {rp.state for rp in plan.regions}
    assert StatePlacement.HOST in states and StatePlacement.STREAMED not in states
