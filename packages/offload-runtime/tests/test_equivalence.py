"""Offloaded training computes exactly what plain PyTorch training computes (CPU, fp32)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tiny_models import (
    UPLOAD_STATS,
    ThreeWayTied,
    forcing_budget,
    inputs,
    loss_of,
    offloaded_half,
    tiny_bert,
    tiny_gpt2,
    tiny_llama,
    uploads_per_step,
)

import offload_runtime.conversions
import offload_runtime.module
from offload_runtime import OffloadConfig, OffloadModule, PlanForce
from offload_runtime.hardware import default_cpu_profile
from offload_runtime.planning import build_offload_module, plan_model

MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": tiny_gpt2,
    "bert": tiny_bert,
    "llama": tiny_llama,
    "tied3": ThreeWayTied,
}


FP32 = OffloadConfig(dtype=torch.float32, fuse_gelu=False)
"""fp32 training of exactly the model's operations (no GELU fusion): plain training's
results."""


def offload(
    model: torch.nn.Module,
    inp: dict[str, torch.Tensor],
    budget: int,
    solver: str,
    config: OffloadConfig = FP32,
    **force: Any,
) -> OffloadModule:
    """``model`` planned on the CPU's default profile, with the planner's choices that
    ``force`` (``PlanForce``'s fields) leaves open, and built."""
    planned = plan_model(
        model,
        inp,
        budget,
        solver,
        config=config,
        hardware=default_cpu_profile(),
        device="cpu",
        progress=False,
        force=PlanForce(**force),
    )
    return build_offload_module(model, planned)


def build(
    name: str,
    solver: str,
    *,
    host_worker: bool | None = None,
    convert: bool | None = None,
    frozen: frozenset[str] = frozenset(),
) -> tuple[torch.nn.Module, OffloadModule, dict[str, torch.Tensor]]:
    """``name``'s model and inputs, planned by ``solver`` at the budget that offloads half
    its regions; ``frozen``: parameters (by name) that do not train."""
    torch.manual_seed(0)
    model = MODELS[name]()
    for pname, param in model.named_parameters():
        param.requires_grad_(pname not in frozen)
    inp = inputs()
    budget = forcing_budget(model, inp, solver, torch.float32, default_cpu_profile())
    module = offload(
        model,
        inp,
        budget,
        solver,
        block_search_range_bytes=0,
        host_worker=host_worker,
        convert_on_device=convert,
    )
    return model, module, inp


def roomy(model: torch.nn.Module, inp: dict[str, torch.Tensor]) -> OffloadModule:
    """``model`` planned in fp32 on the CPU with room for everything (16 GiB): every
    region stays on the device with its optimizer state."""
    return offload(model, inp, 2**34, "asyn", block_search_range_bytes=0)


@pytest.mark.parametrize("chunk", [None, 37])
def test_converting_on_the_device_changes_no_bit_in_bf16(
    chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chunk: convert 37 elements at a time instead of 4M, so that chunks straddle
    # parameters (and parameters span chunks) in both directions: uploads narrowed per
    # chunk, gradients packed and widened per chunk before their copy.
    if chunk is not None:
        monkeypatch.setattr(offload_runtime.conversions, "CONVERT_CHUNK_NUMEL", chunk)
    # bf16 on the CPU: narrowing the fp32 master after the upload (convert_on_device) rounds
    # exactly as casting it on the host first does, and widening gradients before or after
    # the copy is exact, so logits and fp32 gradients agree bit for bit; no training-dtype
    # host copy or staging buffer exists in that mode until something is accumulated.
    results = []
    for convert in (False, True):
        torch.manual_seed(0)
        model = MODELS["gpt2"]()
        inp = inputs()
        hw = default_cpu_profile()
        budget = forcing_budget(model, inp, "asyn", torch.bfloat16, hw)
        module = offload(
            model,
            inp,
            budget,
            "asyn",
            OffloadConfig(dtype=torch.bfloat16),
            block_search_range_bytes=0,
            host_worker=True,
            convert_on_device=convert,
        )
        offloaded = [st for st in module.storages if st.offloaded]
        assert offloaded
        assert module.convert_on_device is convert
        assert all((st.host_params is None) is convert for st in offloaded)
        assert all((st.grad_staging is None) is convert for st in module.storages)
        logits = module(**inp)
        module.backward(loss_of(logits, inp["input_ids"]))
        grads = {k: g.clone() for k, g in module.named_gradients()}
        assert module.controller.stats["grads_to_accumulator"] == (
            sum(st.host_state for st in module.storages) if convert else 0
        )
        results.append((logits.detach().float(), grads))
        module.close()
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.parametrize("chunk", [1, 4, 5, 9, 64])
def test_widen_down_packs_gradients_into_chunks_exactly(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sizes 3, 5, 1, 7 (16 elements): chunk 4 splits the 5 and the 7 and ends exactly on a
    # chunk boundary; 5 and 9 leave a partial last chunk; 64 holds everything in one.
    monkeypatch.setattr(offload_runtime.conversions, "CONVERT_CHUNK_NUMEL", chunk)
    gen = torch.Generator().manual_seed(chunk)
    flats = [torch.randn(n, generator=gen).to(torch.float16) for n in (3, 5, 1, 7)]
    dst = torch.full((16,), float("nan"))
    offload_runtime.conversions.widen_down(flats, dst)
    assert torch.equal(dst, torch.cat(flats).float())
    with pytest.raises(AssertionError, match="cover 15 of 16"):
        offload_runtime.conversions.widen_down([*flats[:-1], flats[-1][:6]], dst)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def assert_one_step_matches(
    model: torch.nn.Module,
    module: OffloadModule,
    inp: dict[str, torch.Tensor],
    *,
    logits_tol: float,
    grad_tol: float,
) -> None:
    """One forward and backward of ``module`` against plain training of ``model``: logits
    and every parameter's gradient (each name of a tied group) within the relative
    tolerances."""
    ref_logits = model(**inp)
    loss_of(ref_logits, inp["input_ids"]).backward()
    logits = module(**inp)
    module.backward(loss_of(logits, inp["input_ids"]))
    assert rel_err(logits.detach(), ref_logits.detach()) <= logits_tol
    grads = dict(module.named_gradients())
    for pname, param in model.named_parameters(remove_duplicate=False):
        assert param.grad is not None
        assert rel_err(grads[pname], param.grad) <= grad_tol, pname


@pytest.mark.parametrize("solver", ["syn", "asyn"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_offloaded_gradients_match_plain_training(name: str, solver: str) -> None:
    model, module, inp = build(name, solver)
    assert offloaded_half(module.plan, solver)
    before = dict(module.controller.stats)
    assert_one_step_matches(model, module, inp, logits_tol=1e-6, grad_tol=1e-6)
    # Every upload ran as the plan says (async ones prefetched, none at use instead).
    stats = module.controller.stats
    assert {k: stats[k] - before[k] for k in UPLOAD_STATS} == uploads_per_step(module.plan)


# Every pair of the three choices' values, in four runs rather than eight.
@pytest.mark.parametrize(
    ("solver", "host_worker", "widen"),
    [("syn", False, False), ("syn", True, True), ("asyn", True, False), ("asyn", False, True)],
)
def test_repeated_steps_accumulate_like_plain_training(
    solver: str, host_worker: bool, widen: bool
) -> None:
    # host_worker=True runs the CUDA machines' threaded host path (gradient accumulation on
    # a worker thread, staging-buffer hand-off between backwards) on the CPU. widen
    # (convert_on_device): the first backward after zero_grad copies fp32 gradients
    # straight into the accumulators; the staging buffer appears only for the second.
    model, module, inp = build("gpt2", solver, host_worker=host_worker, convert=widen)
    if widen:
        assert all(st.grad_staging is None for st in module.storages)
    host_regions = sum(st.host_state for st in module.storages)
    assert host_regions > 0
    other = inputs(seed=1)
    stats = module.controller.stats
    for batch in (inp, other):
        loss_of(model(**batch), batch["input_ids"]).backward()
        module.backward(loss_of(module(**batch), batch["input_ids"]))
    # widen: the first backward lands in the zeroed fp32 accumulators directly, the second
    # goes through staging to be added. Otherwise both go through staging.
    assert stats["grads_to_accumulator"] == (host_regions if widen else 0)
    assert stats["grads_to_staging"] == (host_regions if widen else 2 * host_regions)
    grads = dict(module.named_gradients())
    for pname, param in model.named_parameters():
        assert param.grad is not None
        assert rel_err(grads[pname], param.grad) <= 1e-6, pname
    module.zero_grad()
    module.backward(loss_of(module(**other), other["input_ids"]))  # after zero_grad: direct
    assert stats["grads_to_accumulator"] == (2 * host_regions if widen else 0)
    model.zero_grad()
    loss_of(model(**other), other["input_ids"]).backward()
    grads = dict(module.named_gradients())
    for pname, param in model.named_parameters():
        assert param.grad is not None
        assert rel_err(grads[pname], param.grad) <= 1e-6, pname
    module.zero_grad()
    assert all(float(g.abs().max()) == 0.0 for _, g in module.named_gradients())


@pytest.mark.parametrize("host_worker", [False, True])
def test_frozen_parameters_in_host_state_regions_train_like_plain_training(
    host_worker: bool,
) -> None:
    """A host-state region with a frozen parameter copies the gradients it has into their
    own slots of the staging buffer (the hook's path for a region with gaps); the others
    copy every gradient into the region's kept slot views. Both accumulate over two
    backwards exactly as plain training does, and the frozen parameters have no gradient
    (``named_gradients`` leaves them out, as their ``.grad`` is None in plain training)."""
    frozen = frozenset(
        {"model.transformer.h.1.attn.c_attn.weight", "model.transformer.h.0.ln_1.bias"}
    )
    model, module, inp = build("gpt2", "syn", host_worker=host_worker, convert=False, frozen=frozen)
    host = [st for st in module.storages if st.host_state]
    with_gaps = [st for st in host if not all(lay.requires_grad for lay in st.layouts)]
    assert with_gaps and len(with_gaps) < len(host)
    other = inputs(seed=1)
    for batch in (inp, other):
        loss_of(model(**batch), batch["input_ids"]).backward()
        module.backward(loss_of(module(**batch), batch["input_ids"]))
    assert module.controller.stats["grads_to_staging"] == 2 * len(host)
    grads = dict(module.named_gradients())
    for pname, param in model.named_parameters():
        if pname in frozen:
            assert param.grad is None
            assert pname not in grads, pname
        else:
            assert param.grad is not None
            assert rel_err(grads[pname], param.grad) <= 1e-6, pname
    # The regions without gaps kept one list of slot views; the others made none.
    assert all(st._staging_slots is not None for st in host if st not in with_gaps)
    assert all(st._staging_slots is None for st in with_gaps)


def test_state_dict_round_trip_and_eval_mode() -> None:
    model, module, inp = build("tied3", "asyn")
    state = module.state_dict()
    reference = model.state_dict(keep_vars=False)
    assert set(reference) <= set(state)
    for key, value in reference.items():
        assert torch.equal(state[key], value), key
    # Loading new weights changes what the module computes, exactly like the plain model.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    module.load_state_dict(model.state_dict())
    module.eval()
    model.eval()
    with torch.no_grad():
        assert rel_err(module(**inp), model(**inp)) <= 1e-6
    module.train()


@pytest.mark.parametrize("name", ["gpt2", "tied3"])
def test_the_graph_reads_parameters_without_module_getattr(name: str) -> None:
    """The rewritten graphs read every parameter and buffer from an attribute of their own
    (``flatten_attribute_reads``), with no chain of ``nn.Module.__getattr__`` calls, and
    each such attribute is the very tensor registered under the dotted name (tied ones
    included), so in-place updates reach the graph."""
    _, module, inp = build(name, "asyn")
    for gm in (module._graph_train, module._graph_eval):
        reads = [n for n in gm.graph.nodes if n.op == "get_attr"]
        assert reads
        for node in reads:
            assert "." not in node.target, node.target
            assert node.target in gm.__dict__
        assert "getattr(self." not in gm.code and "self.m." not in gm.code
    registered = {id(t) for t in module._graph_train.parameters()} | {
        id(t) for t in module._graph_train.buffers()
    }
    read = {
        id(module._graph_train.__dict__[n.target])
        for n in module._graph_train.graph.nodes
        if n.op == "get_attr"
    }
    assert read <= registered
    calls = 0
    original = torch.nn.Module.__getattr__

    def counting(self: torch.nn.Module, attr: str) -> Any:
        nonlocal calls
        calls += 1
        return original(self, attr)

    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(torch.nn.Module, "__getattr__", counting)
        module(**inp)
    assert calls < len(read), "parameters are read without nn.Module.__getattr__"
    module.close()


def test_batched_device_gradients_equal_per_region_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room in the budget every device-state region's gradients are folded in at the
    end of backward in one batch; the accumulated fp32 gradients are bit-identical to the
    region-by-region path's and match plain training."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    inp = inputs()
    grads = {}
    for batched in (True, False):
        if not batched:  # no room left in the budget: the region-by-region path
            monkeypatch.setattr(offload_runtime.module, "BUDGET_SAFETY_FACTOR", 0.0)
        module = roomy(model, inp)
        expected = {st.index for st in module.storages} if batched else set()
        assert module.controller.batched_device_regions == expected
        for _ in range(2):  # the second backward accumulates
            module.backward(loss_of(module(**inp), inp["input_ids"]))
        grads[batched] = dict(module.named_gradients())
        module.close()
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[True])
    for _ in range(2):
        loss_of(model(**inp), inp["input_ids"]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None
        assert rel_err(grads[True][name], p.grad) <= 1e-6, name


def test_batched_regions_are_finished_by_the_outputs_hook() -> None:
    """Batched device regions' parameters carry no gradient hook: a hook on the forward's
    outputs queues the end-of-backward callback that folds their gradients in. A backward
    that reaches no parameter (``torch.autograd.grad`` with respect to an input) leaves
    every accumulator as it was, and a forward without grad registers nothing."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    inp = inputs()
    module = roomy(model, inp)
    assert module.controller.batched_device_regions == {st.index for st in module.storages}
    for st in module.storages:
        for param in st.params.values():
            assert not param._post_accumulate_grad_hooks, "a batched region's parameter has a hook"
    module.backward(loss_of(module(**inp), inp["input_ids"]))
    got = {k: v.clone() for k, v in module.named_gradients()}
    loss_of(model(**inp), inp["input_ids"]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None
        assert rel_err(got[name], p.grad) <= 1e-6, name

    # A backward to the outputs only: the callback runs, finds no gradient, changes nothing.
    out = module(**inp)
    (g_out,) = torch.autograd.grad(out.float().pow(2).sum(), out)
    torch.testing.assert_close(g_out, 2 * out.detach())
    assert not module.controller._callback_queued
    after = dict(module.named_gradients())
    assert all(torch.equal(after[k], got[k]) for k in got)

    with torch.no_grad():
        out = module(**inp)
    assert not out.requires_grad
    module.close()


def test_modules_are_freed_and_close_releases_device_memory() -> None:
    """Dropping a trained module frees its storages (no global registry keeps them), and
    close() empties its buffers at once and refuses to run afterwards."""
    _, module, inp = build("gpt2", "asyn", host_worker=True)
    module.backward(loss_of(module(**inp), inp["input_ids"]))
    storages = [weakref.ref(st) for st in module.storages]
    module.close()
    assert module.closed
    assert all(p.numel() == 0 for st in module.storages for p in st.params.values())
    with pytest.raises(RuntimeError, match="closed"):
        module(**inp)
    module.close()  # twice is harmless
    del module
    gc.collect()
    assert all(ref() is None for ref in storages)


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_fused_gelu_trains_like_plain_training_with_less_saved(solver: str) -> None:
    """``OffloadConfig(fuse_gelu=True)``, the default: GPT-2's written-out GELUs run as one
    ``aten.gelu`` each in the offloaded graph; logits and gradients equal plain training's
    to float32 rounding (the fused kernel rounds once, the chain eight times), and the plan
    counts fewer saved bytes than the written-out form's (``fuse_gelu=False``)."""
    torch.manual_seed(0)
    model = tiny_gpt2()
    inp = inputs()
    hw = default_cpu_profile()
    budget = forcing_budget(model, inp, solver, torch.float32, hw)
    plain = offload(model, inp, budget, solver, FP32, block_search_range_bytes=0)
    fused = OffloadConfig(dtype=torch.float32)
    module = offload(model, inp, budget, solver, fused, block_search_range_bytes=0)
    gelus = [n for n in module.graph_module.graph.nodes if n.target is torch.ops.aten.gelu.default]
    layers = sum(1 for n in model.modules() if type(n).__name__ == "NewGELUActivation")
    assert layers > 0 and len(gelus) == layers
    profiles = [m.profile for m in (plain, module)]
    assert profiles[0] is not None and profiles[1] is not None
    saved = [sum(op.saved_bytes for op in p.operations) for p in profiles]
    assert saved[1] < saved[0]
    assert len(profiles[1].operations) == len(profiles[0].operations) - 7 * layers
    plain.close()

    assert_one_step_matches(model, module, inp, logits_tol=1e-5, grad_tol=2e-5)
    module.close()
