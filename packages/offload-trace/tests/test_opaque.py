"""Modules torch.export cannot capture run as one opaque operation each: the trace names
them, costs them, and the traced graph trains exactly as the eager model does (the same
random draws, the same gradients). A failure in the root module's own code still raises
(``test_trace_errors.py``)."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from torch import nn
from trace_helpers import assign_real

from offload_trace import TraceError, trace
from offload_trace._opaque import _ENTRIES, OPAQUE_OP


class _LayerDrop(nn.Module):
    """Layers skipped at random in training, as Hugging Face's layer drop does: a Python
    branch on a drawn value, which export cannot capture."""

    def __init__(self, width: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = torch.tanh(layer(x)) * scale
            x = nn.functional.dropout(x, p=0.2, training=self.training)
        return {"hidden": self.norm(x), "count": torch.ones(x.shape[0], dtype=torch.long)}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.body = _LayerDrop()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(self.embed(x), scale=0.5)
        return self.head(out["hidden"]) * out["count"][:, None]


class _ReadsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        steps = int((y.abs().sum() > 1).item()) + 1  # a value read in Python
        for _ in range(steps):
            y = y * 0.5 + 1
        return y


class _ItemNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _ReadsItem()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The same module at two shapes: two call signatures, one opaque module.
        return self.out(self.inner(x)).sum() + self.inner(x[:1]).sum()


def _train_step(model: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Loss, the gradients of ``x`` and of every parameter, and the next random draw."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_(True)
    loss = model(x).square().mean()
    loss.backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None
    grads = [p.grad if p.grad is not None else torch.zeros(0) for p in model.parameters()]
    return (loss.detach(), x.grad, *grads, torch.rand(4))


def test_a_random_branch_runs_opaquely_and_trains_exactly_like_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(6, 4)
    with caplog.at_level(logging.INFO, logger="offload_trace"):
        traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    assert traced.opaque_modules == ("body",)
    assert any("body (_LayerDrop)" in r.getMessage() for r in caplog.records)
    [op] = [n for n in traced.graph_module.graph.nodes if n.target is OPAQUE_OP]
    # Every parameter and buffer of the module is an input of its one operation.
    reads = {str(n.target) for n in op.all_input_nodes if n.op == "get_attr"}
    assert reads == {name for name, _ in model.body.named_parameters(prefix="body")} | {
        name for name, _ in model.body.named_buffers(prefix="body")
    }
    i = traced.operation_names.index(op.name)
    cost = traced.op_costs[i]
    # Four 6x8 @ 8x8 products forward (layer drop keeps every layer on meta).
    assert cost.fwd_flop >= 4 * 2 * 6 * 8 * 8
    assert cost.bwd_flop == 3 * cost.fwd_flop
    assert cost.saved_bytes > 0 and cost.fwd_tmp_bytes > 0 and cost.bwd_tmp_bytes > 0
    assert set(traced.op_param_names[i]) == {n for n, _ in model.body.named_parameters("body")}
    twin = copy.deepcopy(model)
    gm = assign_real(traced.module_for("cpu"), twin)
    dropped = set()
    for seed in range(6):
        got = _train_step(gm, x, seed)
        expected = _train_step(model, x, seed)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        dropped |= {k for k, layer in enumerate(model.body.layers) if layer.weight.grad is None}
        for module in (twin, model):
            module.zero_grad(set_to_none=True)
    assert dropped, "no layer was ever dropped: the test did not exercise the branch"
    # Batch-norm statistics were updated once per step, as in eager training.
    torch.testing.assert_close(twin.body.norm.running_mean, model.body.norm.running_mean)
    assert int(twin.body.norm.num_batches_tracked) == 6


def test_two_forwards_before_one_backward_train_like_eager() -> None:
    # The second forward updates the batch-norm statistics in place before the first
    # forward's backward reruns the module.
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(6, 4)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    twin = copy.deepcopy(model)
    gm = assign_real(traced.module_for("cpu"), twin)
    for module in (gm, model):
        torch.manual_seed(3)
        (module(x).sum() + module(x * 2).sum()).backward()  # type: ignore[no-untyped-call]
    for (name, got), expected in zip(twin.named_parameters(), model.parameters(), strict=True):
        assert (got.grad is None) == (expected.grad is None), name
        if got.grad is not None:
            torch.testing.assert_close(got.grad, expected.grad, rtol=0, atol=0)
    torch.testing.assert_close(twin.body.norm.running_var, model.body.norm.running_var)


def test_the_eval_graph_runs_the_module_in_eval_mode() -> None:
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(6, 4)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    gm = assign_real(traced.module_for("cpu", training=False), copy.deepcopy(model))
    model.eval()
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    assert traced.graph_module.graph.nodes  # the training graph is untouched
    assert any(n.target is OPAQUE_OP and n.args[1] for n in traced.graph_module.graph.nodes)


def test_item_reads_and_two_call_shapes_share_one_opaque_module() -> None:
    torch.manual_seed(0)
    model = _ItemNet()
    x = torch.randn(3, 4)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    assert traced.opaque_modules == ("inner",)
    assert len(traced.opaque_entries) == 2
    gm = assign_real(traced.module_for("cpu"), copy.deepcopy(model))
    for a, b in zip(_train_step(gm, x, 0), _train_step(model, x, 0), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _OnDevice(nn.Module):
    def forward(self, x: torch.Tensor, device: torch.device) -> torch.Tensor:
        bias = torch.ones(x.shape, device=device)
        return x + bias if bool(x.sum() > 0) else x - bias


class _PassesDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _OnDevice()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, device=x.device) * 2


def test_a_device_argument_traced_on_meta_points_at_the_run_device() -> None:
    model = _PassesDevice()
    x = torch.randn(2, 3)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    assert traced.opaque_modules == ("inner",)
    torch.testing.assert_close(traced.module_for("cpu")(x), model(x), rtol=0, atol=0)
    torch.testing.assert_close(traced.module_for("cpu")(-x), model(-x), rtol=0, atol=0)


def test_entries_live_as_long_as_a_graph_that_calls_them() -> None:
    model = _ItemNet()
    traced = trace(model, (torch.randn(3, 4),), dtype=torch.float32, target_device="cpu")
    keys = [e.key for e in traced.opaque_entries]
    gm = traced.module_for("cpu")
    del traced
    gc.collect()
    assert all(k in _ENTRIES for k in keys)
    del gm
    gc.collect()
    assert not any(k in _ENTRIES for k in keys)


def test_dynamic_batch_with_an_opaque_module_is_refused() -> None:
    with pytest.raises(TraceError, match=r"body \(_LayerDrop\).*dynamic_batch=False"):
        trace(_Net(), (torch.randn(6, 4),), target_device="cpu", dynamic_batch=True)


class _ListReader(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Values copied out to Python: not even the meta run can read them.
        return x * sum(1 for v in x[0].tolist() if v > 0)


class _ValueCut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int((x[0] > 0).sum().item())
        return x[:, :n]  # a shape decided by values; on meta the placeholder 0 decides it


class _Wraps(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1


def test_a_module_that_cannot_run_on_meta_is_named() -> None:
    with pytest.raises(TraceError, match=r"module inner \(_ListReader\).*meta device"):
        trace(_Wraps(_ListReader()), (torch.randn(2, 4),), target_device="cpu")


def test_outputs_whose_shapes_depend_on_values_are_refused_when_run() -> None:
    model = _Wraps(_ValueCut())
    x = torch.ones(2, 4)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    assert traced.opaque_modules == ("inner",)
    with pytest.raises(RuntimeError, match=r"inner \(_ValueCut\).*depend on tensor values"):
        traced.module_for("cpu")(x)
