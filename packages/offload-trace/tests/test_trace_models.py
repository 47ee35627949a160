"""BERT, Llama, a three-way tied module and models with buffers and constants."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from trace_helpers import (
    ThreeWayTied,
    assign_real,
    bert,
    hook_counted_saved_bytes,
    llama,
    token_inputs,
)

from offload_solver import ModelProfile
from offload_trace import trace

HF_MODELS: dict[str, Callable[[float], nn.Module]] = {"bert": bert, "llama": llama}


@pytest.mark.parametrize("name", sorted(HF_MODELS))
@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_hf_saved_bytes_match_a_real_cpu_run_of_the_graph(name: str, dropout: float) -> None:
    torch.manual_seed(0)
    model = HF_MODELS[name](dropout)
    inputs = token_inputs(3, 16)
    traced = trace(model, inputs, dtype=torch.float32, target_device="cpu")
    gm = assign_real(traced.module_for("cpu"), model)
    excluded = [*model.parameters(), *model.buffers()]
    real, out = hook_counted_saved_bytes(lambda: gm(**inputs), excluded)
    assert abs(traced.saved_bytes - real) <= 0.05 * real
    if dropout == 0.0:
        torch.testing.assert_close(out, model(**inputs), rtol=0, atol=0)
    profile = traced.to_profile(name)
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_bert_ties_word_embeddings_to_the_decoder() -> None:
    traced = trace(bert(), token_inputs(2, 8), dtype=torch.float32, target_device="cpu")
    groups = [set(g) for g in traced.tied_groups]
    assert {
        "lm.bert.embeddings.word_embeddings.weight",
        "lm.cls.predictions.decoder.weight",
    } in groups


def test_three_way_tie_is_one_group_and_the_module_matches() -> None:
    torch.manual_seed(0)
    model = ThreeWayTied()
    x = torch.randn(8, 16)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    assert len(traced.tied_groups) == 1
    assert set(traced.tied_groups[0]) == {"first.weight", "second.weight", "third.weight"}
    used = [names for names in traced.op_param_names if set(names) & set(traced.tied_groups[0])]
    assert len(used) == 3 and used[0][0] == traced.tied_groups[0][0]
    profile = traced.to_profile()
    assert profile.total_param_numel == sum(p.numel() for p in model.parameters())
    assert ModelProfile.from_json(profile.to_json()) == profile

    assert set(traced.buffer_names) == {
        "scale",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    }
    reference = ThreeWayTied()
    reference.load_state_dict(model.state_dict())
    gm = assign_real(traced.module_for("cpu", training=False), reference)
    reference.eval()
    model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_buffers_are_updated_in_training_like_the_model() -> None:
    """Batch-norm running statistics are graph mutations that module_for keeps."""
    torch.manual_seed(0)
    model = ThreeWayTied()
    model.drop.p = 0.0
    twin = ThreeWayTied()
    twin.load_state_dict(model.state_dict())
    twin.drop.p = 0.0
    x = torch.randn(8, 16)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    gm = assign_real(traced.module_for("cpu"), twin)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(twin.norm.running_mean, model.norm.running_mean)
    assert int(twin.norm.num_batches_tracked) == int(model.norm.num_batches_tracked) == 1


class _WithConstants(nn.Module):
    def __init__(self, on_input_device: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.on_input_device = on_input_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x) * torch.tensor(2.0)  # a CPU scalar: lifted with its value
        if self.on_input_device:
            y = y + torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)
        return y


def test_lifted_cpu_constants_keep_their_values() -> None:
    model = _WithConstants(on_input_device=False)
    x = torch.randn(3, 4)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    gm = assign_real(traced.module_for("cpu"), model)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_constants_created_on_the_input_device_are_refused_by_name() -> None:
    model = _WithConstants(on_input_device=True)
    traced = trace(model, (torch.randn(3, 4),), dtype=torch.float32, target_device="cpu")
    assert len(traced.valueless_constants) == 1
    # Costs are still available; only a runnable module is impossible.
    assert traced.to_profile().operations
    with pytest.raises(RuntimeError, match=traced.valueless_constants[0]) as info:
        traced.module_for("cpu")
    assert "register_buffer" in str(info.value)


class _NoGradRegion(nn.Module):
    """A ``torch.no_grad()`` block with a device-dependent factory, as in rotary
    embeddings: export nests it in a ``wrap_with_set_grad_enabled`` subgraph."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("freq", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            pos = torch.arange(x.shape[0], device=x.device, dtype=x.dtype)[:, None]
            angle = pos * self.freq
        return self.drop(self.proj(x)) * angle.cos()


def test_module_for_rewrites_nested_graphs() -> None:
    torch.manual_seed(0)
    model = _NoGradRegion()
    x = torch.randn(3, 4)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    nested = [m for m in traced.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(nested) >= 2  # the premise: the no_grad block is a nested graph
    gm = assign_real(traced.module_for("cpu", training=False), model)
    model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    model.train()
    train_gm = assign_real(traced.module_for("cpu"), model)
    out = train_gm(x)
    assert out.requires_grad and torch.is_grad_enabled()


class _DeviceBranchHistc(nn.Module):
    """Counts token ids the way Hugging Face's grouped-matmul experts do: ``histc`` of
    int32 ids off the CPU, of float ids on it (the CPU has no integer kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        counted = ids.float() if ids.device.type == "cpu" else ids.int()
        counts = torch.histc(counted, bins=4, min=0, max=3)
        return self.proj(x) * torch.cumsum(counts, dim=0, dtype=torch.int32)


def test_module_for_cpu_counts_integer_histc_in_float64() -> None:
    torch.manual_seed(0)
    model = _DeviceBranchHistc()
    x, ids = torch.randn(3, 4), torch.tensor([3, 0, 1, 3, 3, 2, 0])
    traced = trace(model, (x, ids), dtype=torch.float32, target_device="cpu")
    # The premise: traced on meta, the branch for other devices put an int32 histc in.
    histc = [n for n in traced.graph_module.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert [n.args[0].meta["val"].dtype for n in histc] == [torch.int32]
    gm = assign_real(traced.module_for("cpu"), model)
    ops = ("call_function", "call_method", "call_module")
    names = tuple(n.name for n in gm.graph.nodes if n.op in ops)
    assert names == traced.operation_names  # the node keeps its name; only its target changes
    torch.testing.assert_close(gm(x, ids), model(x, ids), rtol=0, atol=0)


def test_module_for_rejects_a_bad_device() -> None:
    traced = trace(ThreeWayTied(), (torch.randn(4, 16),), target_device="cpu")
    with pytest.raises(ValueError, match="'meta'"):
        traced.module_for("meta")
    with pytest.raises(ValueError, match="'gpu0' is not a torch device"):
        traced.module_for("gpu0")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_profile_sizes(dtype: torch.dtype) -> None:
    with torch.device("meta"):
        model = llama()
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    traced = trace(model, {"input_ids": ids, "attention_mask": ids}, dtype=dtype)
    profile = traced.to_profile()
    assert profile.device_state_bytes_per_param == 16
    assert profile.host_grad_bytes_per_param == 2
    for p in profile.parameters:
        assert p.size_bytes == 2 * p.numel
    assert all(t.dtype == dtype for t in traced.graph_module.parameters())


def test_profile_marks_frozen_parameters() -> None:
    model = ThreeWayTied()
    model.first.weight.requires_grad_(False)  # the tied group's one storage
    model.norm.bias.requires_grad_(False)
    profile = trace(model, (torch.randn(4, 16),), target_device="cpu").to_profile()
    frozen = {p.name for p in profile.parameters if not p.trainable}
    assert frozen == {"first.weight", "second.weight", "third.weight", "norm.bias"}
    assert profile.trainable_param_numel == profile.total_param_numel - 16 * 16 - 16
    assert ModelProfile.from_json(profile.to_json()) == profile
