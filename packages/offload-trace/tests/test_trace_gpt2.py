"""GPT-2: saved bytes, FLOPs, tied weights, the profile and the runnable module."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from trace_helpers import (
    GPT2_SIZES,
    assign_real,
    gpt2,
    gpt2_reference,
    hook_counted_saved_bytes,
    param_count,
    token_inputs,
)

from offload_solver import ModelProfile
from offload_trace import TracedModel, trace


@pytest.fixture(scope="module")
def traced_gpt2() -> tuple[torch.nn.Module, dict[str, torch.Tensor], TracedModel]:
    torch.manual_seed(0)
    model = gpt2(dropout=0.1)
    inputs = token_inputs(4, 16)
    return model, inputs, trace(model, inputs, dtype=torch.float32, target_device="cpu")


def _real_graph_saved(model: torch.nn.Module, traced: TracedModel, inputs: dict) -> int:
    gm = assign_real(traced.module_for("cpu"), model)
    excluded = [*model.parameters(), *model.buffers()]
    saved, _ = hook_counted_saved_bytes(lambda: gm(**inputs), excluded)
    return saved


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_saved_bytes_match_a_real_cpu_run(dropout: float) -> None:
    """Predicted saved bytes equal what saved_tensors_hooks counts on a real CPU run.

    With dropout the CPU runs attention's math path; without, its flash kernel, which the
    kernel model stands in for. The traced graph must match to the byte; eager Hugging
    Face (which skips an all-ones mask) within 5%.
    """
    torch.manual_seed(0)
    model = gpt2(dropout=dropout)
    inputs = token_inputs(4, 16)
    traced = trace(model, inputs, dtype=torch.float32, target_device="cpu")
    predicted = traced.saved_bytes
    assert predicted == _real_graph_saved(model, traced, inputs)
    excluded = [*model.parameters(), *model.buffers()]
    eager, _ = hook_counted_saved_bytes(lambda: model(**inputs), excluded)
    assert abs(predicted - eager) <= 0.05 * eager


def test_counting_saved_bytes_frees_the_graph_with_its_output() -> None:
    """The counting hook keeps nothing alive: a saved output kept as is would hold its own
    grad_fn, a cycle the collector cannot break, and the whole graph would stay alive."""
    x = torch.randn(64, requires_grad=True)
    saved, out = hook_counted_saved_bytes(lambda: torch.sigmoid(x * 2.0), [x])
    assert saved == 64 * 4  # sigmoid saves its output; a product with a number saves nothing
    gone = weakref.ref(out)
    del out
    gc.collect()
    assert gone() is None


def test_flops_are_six_times_parameters_times_tokens(
    traced_gpt2: tuple[torch.nn.Module, dict[str, torch.Tensor], TracedModel],
) -> None:
    # Attention is negligible when the sequence is short next to the width; position
    # embeddings are few. The traced fixture is too narrow for that, so use a wider one.
    model = gpt2(hidden=256, layers=2, heads=4, vocab=512, positions=8)
    batch, seq = 8, 8
    traced = trace(model, token_inputs(batch, seq, 512), target_device="cpu")
    total = traced.fwd_flop + traced.bwd_flop
    expected = 6 * param_count(model) * batch * seq
    assert abs(total - expected) <= 0.02 * expected
    # Backward of a matmul is two matmuls.
    assert traced.bwd_flop == pytest.approx(2 * traced.fwd_flop, rel=0.02)


def test_tied_embedding_and_head_form_one_group_used_head_first(
    traced_gpt2: tuple[torch.nn.Module, dict[str, torch.Tensor], TracedModel],
) -> None:
    _model, _inputs, traced = traced_gpt2
    assert len(traced.tied_groups) == 1
    group = traced.tied_groups[0]
    assert set(group) == {"lm.lm_head.weight", "lm.transformer.wte.weight"}
    # The first op that reads the group names its first member.
    first = next(names for names in traced.op_param_names if set(names) & set(group))
    assert group[0] in first


def test_param_names_map_graph_attributes_to_original_names(
    traced_gpt2: tuple[torch.nn.Module, dict[str, torch.Tensor], TracedModel],
) -> None:
    model, _inputs, traced = traced_gpt2
    original = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(traced.param_names.values()) <= original
    used = {n for names in traced.op_param_names for n in names}
    # Every parameter is read by some op, one name per tied group.
    assert len(used) == len(original) - 1
    assert {p.name for p in traced.parameters} == original


def test_profile_round_trips_through_json_and_describes_the_graph(
    traced_gpt2: tuple[torch.nn.Module, dict[str, torch.Tensor], TracedModel],
) -> None:
    model, _inputs, traced = traced_gpt2
    profile = traced.to_profile("tiny-gpt2")
    again = ModelProfile.from_json(profile.to_json())
    assert again == profile
    assert tuple(op.name for op in profile.operations) == traced.operation_names
    assert profile.total_param_numel == param_count(model)
    assert profile.device_state_bytes_per_param == 12  # fp32: moments + gradient
    assert profile.host_grad_bytes_per_param == 4
    assert sum(op.saved_bytes for op in profile.operations) == traced.saved_bytes


def test_the_memory_model_reproduces_the_measured_live_bytes(
    traced_gpt2: tuple[torch.nn.Module, dict[str, torch.Tensor], TracedModel],
) -> None:
    """saved(<i) + out(i) + tmp(i) is the live activation bytes measured at op i."""
    _model, _inputs, traced = traced_gpt2
    profile = traced.to_profile()
    saved_before = 0
    for op, cost in zip(profile.operations, traced.op_costs, strict=True):
        assert saved_before + op.fwd_out_bytes + op.fwd_tmp_bytes == cost.fwd_peak_bytes
        saved_before += op.saved_bytes
    # In backward the model keeps saved(<=i); the measured level is never below it
    # by more than the clamp allows, and the peak is reproduced wherever unclamped.
    saved_upto = 0
    reproduced = 0
    for op, cost in zip(profile.operations, traced.op_costs, strict=True):
        saved_upto += op.saved_bytes
        modelled = saved_upto + op.bwd_out_bytes + op.bwd_tmp_bytes
        assert modelled >= cost.bwd_peak_bytes
        reproduced += modelled == cost.bwd_peak_bytes
    assert reproduced >= 0.9 * len(profile.operations)


def test_module_for_cpu_computes_what_the_model_computes() -> None:
    torch.manual_seed(0)
    model = gpt2(dropout=0.0)
    inputs = token_inputs(2, 12)
    traced = trace(model, inputs, dtype=torch.float32, target_device="cpu")
    gm = assign_real(traced.module_for("cpu"), model)
    names = tuple(n.name for n in gm.graph.nodes if n.op.startswith("call"))
    assert names == traced.operation_names
    assert all(p.device.type == "meta" for p in traced.graph_module.parameters())
    torch.testing.assert_close(gm(**inputs), model(**inputs), rtol=0, atol=0)


def test_module_for_eval_turns_dropout_off() -> None:
    torch.manual_seed(0)
    model = gpt2(dropout=0.3)
    inputs = token_inputs(2, 12)
    traced = trace(model, inputs, dtype=torch.float32, target_device="cpu")
    train_gm = assign_real(traced.module_for("cpu"), model)
    eval_gm = assign_real(traced.module_for("cpu", training=False), model)
    model.eval()
    expected = model(**inputs)
    torch.testing.assert_close(eval_gm(**inputs), expected, rtol=0, atol=0)
    assert not torch.equal(train_gm(**inputs), expected)


def test_dynamic_batch_runs_other_batch_sizes() -> None:
    torch.manual_seed(0)
    model = gpt2(dropout=0.0)
    traced = trace(
        model, token_inputs(4, 8), dtype=torch.float32, target_device="cpu", dynamic_batch=True
    )
    gm = assign_real(traced.module_for("cpu"), model)
    other = token_inputs(3, 8)
    torch.testing.assert_close(gm(**other), model(**other), rtol=0, atol=0)


def test_cuda_target_models_fused_attention_and_dropout() -> None:
    """On CUDA attention saves q/k/v, output, a float32 log-sum-exp and the converted
    mask; dropout saves a one-byte mask."""
    batch, seq, hidden, heads = 2, 32, 64, 4
    with torch.device("meta"):
        model = gpt2(hidden, 1, heads, positions=seq)
    traced = trace(model, token_inputs(batch, seq), dtype=torch.float16, target_device="cuda")
    costs = {c.name: c for c in traced.op_costs}
    qkv = 3 * batch * seq * hidden * 2
    out = batch * seq * hidden * 2
    lse = batch * heads * seq * 4
    mask = batch * seq * seq * 2
    assert costs["scaled_dot_product_attention"].saved_bytes == qkv + out + lse + mask
    assert costs["dropout_1"].saved_bytes == batch * seq * hidden
    cpu = trace(model, token_inputs(batch, seq), dtype=torch.float16, target_device="cpu")
    # The math path (CPU with dropout) keeps score matrices: far more bytes.
    assert cpu.saved_bytes > traced.saved_bytes


def test_gpt2_medium_and_10b_trace_on_meta() -> None:
    for name in ("gpt2_medium", "gpt2_10b"):
        model = gpt2_reference(name)
        ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
        traced = trace(model, {"input_ids": ids, "attention_mask": ids})
        profile = traced.to_profile(name)
        _hidden, layers, _heads = GPT2_SIZES[name]
        assert profile.total_param_numel == param_count(model)
        assert sum(op.name.startswith("scaled_dot_product") for op in profile.operations) == (
            layers
        )
        total = traced.fwd_flop + traced.bwd_flop
        assert abs(total - 6 * param_count(model) * 32) <= 0.02 * total
        assert profile.device_state_bytes_per_param == 16
        assert ModelProfile.from_json(profile.to_json()) == profile


# gpt2_14b and gpt2_24b are more layers of gpt2_10b's and gpt2_20b's: nothing new to trace.
@pytest.mark.parametrize("name", ["gpt2_xl", "gpt2_20b"])
def test_other_reference_sizes_trace_on_meta(name: str) -> None:
    model = gpt2_reference(name)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    traced = trace(model, {"input_ids": ids, "attention_mask": ids})
    profile = traced.to_profile(name)
    assert profile.total_param_numel == param_count(model)
    assert traced.tied_groups[0][0] == "lm.lm_head.weight"


class _Split(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.lin(x).split(8, dim=-1)
        return (torch.tanh(q * k) + v).sum()


def test_operations_number_their_storages_and_read_views_as_their_storage() -> None:
    """``out_storage_bytes`` splits ``fwd_out_bytes`` into storages, numbered in forward
    order; ``reads`` names the storages an operation's inputs live in, so two views of
    one output are one storage, and the model's inputs and parameters none."""
    x = torch.randn(4, 8)
    profile = trace(_Split(), (x,), dtype=torch.float32, target_device="cpu").to_profile()
    ops = profile.operations
    made = 0
    for op in ops:
        assert sum(op.out_storage_bytes) == op.fwd_out_bytes
        assert all(s < made for s in op.reads)  # only storages made before it
        made += len(op.out_storage_bytes)
    by_name = {op.name.rstrip("_0123456789"): op for op in ops}
    linear = [i for i, op in enumerate(ops) if op.name.startswith("linear")]
    assert len(linear) == 1 and ops[linear[0]].reads == ()  # x and the weights: none
    first = sum(len(op.out_storage_bytes) for op in ops[: linear[0]])
    assert ops[linear[0]].out_storage_bytes == (4 * 24 * 4,)
    assert by_name["mul"].reads == (first,)  # q and k: views of the linear's output
    assert first in by_name["add"].reads  # v, a view of it too
