"""A plan's activation placements (keep, recompute, host) train exactly as plain PyTorch.

The plans here are the solver's plan for a tiny GPT-2 with dropout on, with placements
set by hand per region so that every mix is exercised; the last test lets the planner
choose them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import pytest
import torch
from tiny_models import VOCAB, forcing_budget, gpt2, inputs, loss_of

from offload_runtime import OffloadConfig, OffloadModule, PlanForce
from offload_runtime.hardware import default_cpu_profile
from offload_runtime.planning import PlannedModel, build_offload_module, plan_model
from offload_solver import ActivationPlacement, InfeasibleBudgetError, ParamPlacement
from offload_solver.simulators._activations import boundary_bytes

KEEP = ActivationPlacement.KEEP
RECOMPUTE = ActivationPlacement.RECOMPUTE
HOST = ActivationPlacement.HOST
WITH_PREVIOUS = ActivationPlacement.RECOMPUTE_WITH_PREVIOUS

# Region indices of the plan below (14 regions: 0 the embeddings, resident; 13 the final
# norm and head, sync; the rest async). Each mix has resident and offloaded regions, and
# HOST regions next to each other, so that one HOST region's backward start is the one that
# brings back the next's tensors. In "runs" and "runs_mix" regions are recomputed in runs,
# one ending in the offloaded last region; ``with_activations`` makes every region of a
# run but the last resident, as plans must.
MIXES: dict[str, dict[int, ActivationPlacement]] = {
    "keep": {},
    "recompute": {0: RECOMPUTE, 1: RECOMPUTE, 4: RECOMPUTE, 8: RECOMPUTE, 12: RECOMPUTE},
    "host": {0: HOST, 1: HOST, 2: HOST, 6: HOST, 13: HOST},
    "mix": {0: HOST, 1: RECOMPUTE, 2: HOST, 3: HOST, 6: RECOMPUTE, 7: RECOMPUTE, 10: HOST},
    "recompute_all": dict.fromkeys(range(14), RECOMPUTE),
    "host_all": dict.fromkeys(range(14), HOST),
    "runs": {
        0: RECOMPUTE,
        1: WITH_PREVIOUS,
        2: WITH_PREVIOUS,
        5: RECOMPUTE,
        6: WITH_PREVIOUS,
        9: RECOMPUTE,
        10: WITH_PREVIOUS,
        11: WITH_PREVIOUS,
        12: WITH_PREVIOUS,
        13: WITH_PREVIOUS,
    },
    "runs_mix": {
        1: HOST,
        2: RECOMPUTE,
        3: WITH_PREVIOUS,
        4: HOST,
        6: RECOMPUTE,
        8: RECOMPUTE,
        9: WITH_PREVIOUS,
        10: KEEP,
        11: RECOMPUTE,
        12: WITH_PREVIOUS,
    },
}


def dropout_gpt2() -> torch.nn.Module:
    """A tiny GPT-2 with every dropout at 0.1, in training mode."""
    torch.manual_seed(0)
    return gpt2(32, 3, 4, vocab=VOCAB, positions=32, dropout=0.1).train()


def planned(model: torch.nn.Module, inp: dict[str, torch.Tensor]) -> PlannedModel:
    """The solver's fp32 plan of ``model`` at a budget that offloads half its regions."""
    budget = forcing_budget(model, inp, "asyn", torch.float32, default_cpu_profile())
    return _plan_at(model, inp, budget)


def with_activations(
    model: torch.nn.Module, base: PlannedModel, modes: Mapping[int, ActivationPlacement]
) -> OffloadModule:
    """``base``'s plan with ``modes`` (region index to placement; KEEP elsewhere), built;
    a region that a later one is recomputed with is made resident."""
    regions = tuple(
        dataclasses.replace(rp, activations=modes.get(rp.region.index, KEEP))
        if modes.get(rp.region.index + 1) is not WITH_PREVIOUS
        else dataclasses.replace(
            rp,
            activations=modes.get(rp.region.index, KEEP),
            placement=ParamPlacement.RESIDENT,
            prefetch_at=None,
            pool_offset_bytes=None,
        )
        for rp in base.plan.regions
    )
    plan = dataclasses.replace(base.plan, regions=regions)
    return build_offload_module(model, dataclasses.replace(base, plan=plan))


@pytest.fixture(scope="module")
def setup() -> tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel]:
    model = dropout_gpt2()
    inp = inputs()
    base = planned(model, inp)
    assert len(base.plan.regions) == 14
    kinds = {rp.placement for rp in base.plan.regions}
    assert kinds == {ParamPlacement.RESIDENT, ParamPlacement.SYNC, ParamPlacement.ASYNC}
    return model, inp, base


def plain_gradients(
    model: torch.nn.Module, inp: dict[str, torch.Tensor], seed: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = model(**inp)
    loss_of(logits, inp["input_ids"]).backward()  # type: ignore[no-untyped-call]
    grads = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        assert param.grad is not None
        grads[name] = param.grad.clone()
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def test_dropout_is_on(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel],
) -> None:
    model, inp, _ = setup
    a, _ = plain_gradients(model, inp, seed=1)
    b, _ = plain_gradients(model, inp, seed=2)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_gradients_match_plain_training_with_dropout(
    mix: str, setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel]
) -> None:
    model, inp, base = setup
    modes = MIXES[mix]
    module = with_activations(model, base, modes)
    ref_logits, ref_grads = plain_gradients(model, inp, seed=7)
    torch.manual_seed(7)
    logits = module(**inp)
    module.backward(loss_of(logits, inp["input_ids"]))
    after = torch.get_rng_state()
    torch.manual_seed(7)
    plain_gradients(model, inp, seed=7)
    # Recomputation restores the generator: it ends where plain training leaves it.
    assert torch.equal(after, torch.get_rng_state())
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-5, atol=1e-7)
    grads = dict(module.named_gradients())
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)
    stats = module.controller.activations.stats
    assert stats["recomputes"] == sum(m is RECOMPUTE for m in modes.values())
    assert stats["host_copies_down"] == stats["host_copies_up"]
    assert (stats["host_copies_down"] > 0) == (HOST in modes.values())
    module.close()


def held_bytes(module: OffloadModule, inp: dict[str, torch.Tensor]) -> tuple[int, int, object]:
    """(device bytes, host bytes) of the saved activations held between the forward and
    the backward (parameters and buffers not counted, each storage once), and the loss.

    Regions without the controller's hooks save through this test's hooks; the others
    through the controller's, whose pack either keeps a tensor or hands it to a frame."""
    acts = module.controller.activations
    kept: list[torch.Tensor] = []
    original = acts.pack

    def counting_pack(r: int, t: torch.Tensor) -> object:
        packed = original(r, t)
        if packed is t:
            kept.append(t)
        return packed

    def outer_pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    acts.pack = counting_pack  # type: ignore[method-assign]
    try:
        torch.manual_seed(3)
        with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda t: t):
            loss = loss_of(module(**inp), inp["input_ids"])
    finally:
        del acts.pack
    device, host = acts.held_tensors()

    def total(tensors: list[torch.Tensor]) -> int:
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors
            if not acts.fixed(t)
        }
        return sum(storages.values())

    return total([*kept, *device]), total(host), loss


def test_recompute_and_host_hold_fewer_device_bytes(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel],
) -> None:
    model, inp, base = setup
    measured = {}
    for mix in ("keep", "recompute", "host", "recompute_all", "host_all"):
        module = with_activations(model, base, MIXES[mix])
        device, host, loss = held_bytes(module, inp)
        measured[mix] = (device, host)
        module.backward(loss)  # type: ignore[arg-type]
        module.close()
    keep_device, keep_host = measured["keep"]
    assert keep_device > 0 and keep_host == 0
    # Recomputed regions hold only their inputs (the previous region's output, mostly
    # held anyway); what they save is gone.
    assert measured["recompute"][0] < 0.8 * keep_device
    assert measured["recompute"][1] == 0
    assert measured["recompute_all"][0] < 0.3 * keep_device
    # What HOST regions save moved to host tensors: the device holds less by about as
    # much as the host now holds.
    host_device, host_host = measured["host"]
    assert host_host > 0.2 * keep_device
    assert host_device < keep_device - host_host / 2
    all_device, all_host = measured["host_all"]
    assert all_device < 0.1 * keep_device
    assert all_host > 0.9 * keep_device


@pytest.mark.parametrize("mix", ["recompute", "recompute_all", "mix", "runs", "runs_mix"])
def test_recomputed_regions_hold_the_inputs_the_simulator_prices(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel], mix: str
) -> None:
    """What the frames of recomputed regions and runs hold between forward and backward
    (their inputs: views hold whole storages, each storage once, the model's inputs left
    out) is what the simulator's ``boundary_bytes`` prices for that choice."""
    model, inp, base = setup
    modes = [MIXES[mix].get(r, KEEP) for r in range(len(base.plan.regions))]
    module = with_activations(model, base, MIXES[mix])
    acts = module.controller.activations
    torch.manual_seed(3)
    loss = loss_of(module(**inp), inp["input_ids"])
    inputs = {t.untyped_storage().data_ptr() for t in inp.values()}
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in acts.held_tensors()[0]
        if t.untyped_storage().data_ptr() not in inputs
    }
    regions = [rp.region for rp in base.plan.regions]
    priced = boundary_bytes(base.profile.operations, regions, modes)
    want = sum(b for b, m in zip(priced, modes, strict=True) if m in (RECOMPUTE, WITH_PREVIOUS))
    assert want > 0
    assert sum(held.values()) == want
    module.backward(loss)
    module.close()


def test_log_names_each_region_that_does_not_keep_its_activations(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, _, base = setup
    with caplog.at_level(logging.INFO, logger="offload_runtime"):
        module = with_activations(model, base, MIXES["runs_mix"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("activations:")]
    words = {RECOMPUTE: "recomputes", WITH_PREVIOUS: "recomputed with region", HOST: "host memory"}
    for r, mode in MIXES["runs_mix"].items():
        if mode is KEEP:
            continue
        assert sum(f"region {r} " in line and words[mode] in line for line in lines) == 1, (
            r,
            lines,
        )
    assert (
        "5 regions keep them on the device, 7 recompute them in 4 runs, 2 hold them" in (lines[-1])
    )
    module.close()


def test_a_retained_graph_runs_backward_twice(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel],
) -> None:
    model, inp, base = setup
    _, ref_grads = plain_gradients(model, inp, seed=5)
    module = with_activations(model, base, MIXES["mix"])
    torch.manual_seed(5)
    loss = loss_of(module(**inp), inp["input_ids"])
    loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
    loss.backward()  # type: ignore[no-untyped-call]
    grads = dict(module.named_gradients())
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], 2 * ref, rtol=1e-5, atol=1e-7, msg=name)
    assert module.controller.activations.stats["recomputes"] == 6
    module.close()


def test_host_tensors_come_back_when_the_next_region_starts_its_backward(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel],
) -> None:
    model, inp, base = setup
    modes = MIXES["host"]
    module = with_activations(model, base, modes)
    controller = module.controller
    acts = controller.activations
    order: list[tuple[str, int]] = []
    pre_backward, fetch = controller.pre_backward, acts._fetch

    def logged_pre_backward(r: int) -> None:
        order.append(("backward", r))
        pre_backward(r)

    def logged_fetch(frame: object, indices: object) -> None:
        order.append(("fetch", frame.region))  # type: ignore[attr-defined]
        fetch(frame, indices)  # type: ignore[arg-type]

    controller.pre_backward = logged_pre_backward  # type: ignore[method-assign]
    acts._fetch = logged_fetch  # type: ignore[method-assign]
    torch.manual_seed(0)
    module.backward(loss_of(module(**inp), inp["input_ids"]))
    fetched = [r for kind, r in order if kind == "fetch"]
    assert sorted(fetched) == sorted(modes)  # each HOST region's tensors once
    for r in modes:
        at = order.index(("fetch", r))
        # Issued at the backward start of region r + 1 (or of r itself for the last
        # region), and before r's backward starts when r + 1 comes first.
        assert order[at - 1] in (("backward", r + 1), ("backward", r)), order
        if r + 1 < len(base.plan.regions):
            assert order.index(("backward", r + 1)) < at
    module.close()


class BatchNormed(torch.nn.Module):
    """Linear, batch norm, linear: training mode updates the norm's running statistics
    (and counts batches) in place, buffers its regions read from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.a(x)))  # type: ignore[no-any-return]


def test_a_region_that_updates_what_it_reads_in_place_is_not_recomputed() -> None:
    torch.manual_seed(0)
    model = BatchNormed()
    inp = {"x": torch.randn(4, 8)}
    base = plan_model(
        model,
        inp,
        2**30,
        "asyn",
        config=OffloadConfig(dtype=torch.float32),
        hardware=default_cpu_profile(),
        device="cpu",
        progress=False,
        force=PlanForce(block_search_range_bytes=0),
    )
    # Recomputing would count the batch, and update the running statistics, twice.
    with pytest.raises(ValueError, match="cannot be recomputed"):
        with_activations(model, base, dict.fromkeys(range(3), RECOMPUTE))
    # Holding its activations on the host changes nothing of the kind.
    module = with_activations(model, base, dict.fromkeys(range(3), HOST))
    module.backward(module(**inp).square().sum())
    model(**inp).square().sum().backward()  # type: ignore[no-untyped-call]
    grads = dict(module.named_gradients())
    for name, param in model.named_parameters():
        assert param.grad is not None
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    state = module.state_dict()
    for name, buf in model.named_buffers():
        torch.testing.assert_close(state[name], buf, msg=name)
    module.close()


def _plan_at(
    model: torch.nn.Module, inp: dict[str, torch.Tensor], budget: int, **force: object
) -> PlannedModel:
    return plan_model(
        model,
        inp,
        budget,
        "asyn",
        config=OffloadConfig(dtype=torch.float32, fuse_gelu=False),
        hardware=default_cpu_profile(),
        device="cpu",
        progress=False,
        force=PlanForce(block_search_range_bytes=0, **force),  # type: ignore[arg-type]
    )


def _least_budget(model: torch.nn.Module, inp: dict[str, torch.Tensor], **force: object) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        _plan_at(model, inp, 1, **force)
    return info.value.least_budget_bytes


def test_planner_moves_activations_where_keeping_them_does_not_fit(
    setup: tuple[torch.nn.Module, dict[str, torch.Tensor], PlannedModel],
) -> None:
    """Between the least budget with every region's activations kept and the least with
    every region's recomputed, the planner recomputes or moves some regions' activations,
    and the module it builds trains exactly as plain PyTorch with dropout on."""
    model, inp, _ = setup
    keep_least = _least_budget(model, inp, activations=False)
    least = _least_budget(model, inp)
    assert least < keep_least
    budget = (least + keep_least) // 2
    with pytest.raises(InfeasibleBudgetError):
        _plan_at(model, inp, budget, activations=False)
    planned_model = _plan_at(model, inp, budget)
    modes = [rp.activations for rp in planned_model.plan.regions]
    assert any(m is not KEEP for m in modes)
    assert any(m is KEEP for m in modes), "a budget above the least should keep some"
    assert planned_model.plan.predicted_peak_bytes <= budget
    module = build_offload_module(model, planned_model)
    ref_logits, ref_grads = plain_gradients(model, inp, seed=11)
    torch.manual_seed(11)
    logits = module(**inp)
    module.backward(loss_of(logits, inp["input_ids"]))
    torch.testing.assert_close(logits.detach(), ref_logits, rtol=1e-5, atol=1e-7)
    grads = dict(module.named_gradients())
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=name)
    module.close()
