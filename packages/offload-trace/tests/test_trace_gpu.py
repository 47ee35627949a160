"""Predictions against a real CUDA run (gpt2_medium, fp16); run with ``nox -s gpu_tests``."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from trace_helpers import (
    GPT2_SIZES,
    VOCAB,
    IdsOnly,
    assign_real,
    gpt2,
    hook_counted_saved_bytes,
)

from offload_trace import TracedModel, trace

pytestmark = pytest.mark.gpu

WORKLOADS = [(64, 8), (8, 1024)]


@pytest.fixture(autouse=True)
def _say_what_stays(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the device memory still allocated after each test, once garbage is collected,
    so that a test that leaves memory behind for the next package's gpu tests shows in the
    log."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        held = torch.cuda.memory_allocated() / 2**20
        print(f"[{request.node.name}: {held:.1f} MiB allocated after the test]")


def _traced_and_real(
    batch: int, seq: int, *, fuse_gelu: bool = False
) -> tuple[TracedModel, torch.fx.GraphModule, torch.nn.Module, dict[str, torch.Tensor]]:
    hidden, layers, heads = GPT2_SIZES["gpt2_medium"]
    positions = max(1024, seq)
    with torch.device("meta"):
        meta_model = gpt2(hidden, layers, heads, vocab=VOCAB, positions=positions)
    meta_ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    traced = trace(
        meta_model,
        {"input_ids": meta_ids, "attention_mask": meta_ids},
        dtype=torch.float16,
        target_device="cuda",
        fuse_gelu=fuse_gelu,
    )
    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        real = gpt2(hidden, layers, heads, vocab=VOCAB, positions=positions).half()
    gm = assign_real(traced.module_for(device), real)
    ids = torch.randint(0, VOCAB, (batch, seq), device=device)
    return traced, gm, real, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _warm_up(gm: torch.fx.GraphModule, real: torch.nn.Module, inputs: dict) -> None:
    """One step first, so cuBLAS / cuDNN workspaces are not counted as activations."""
    out = gm(**inputs)
    out.backward(torch.zeros_like(out))
    for p in real.parameters():
        p.grad = None
    del out
    torch.cuda.synchronize()


def _forward_peak_prediction(traced: TracedModel) -> int:
    predicted = 0
    saved_before = 0
    for op in traced.to_profile().operations:
        predicted = max(predicted, saved_before + op.fwd_out_bytes + op.fwd_tmp_bytes)
        saved_before += op.saved_bytes
    return predicted


def _measured_forward_peak(
    gm: torch.fx.GraphModule, real: torch.nn.Module, inputs: dict[str, torch.Tensor]
) -> int:
    """Peak bytes a forward (with grad) allocates beyond what was allocated before it."""
    _warm_up(gm, real, inputs)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()  # parameters, inputs and workspaces
    with torch.enable_grad():
        out = gm(**inputs)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    del out
    return measured


@pytest.mark.parametrize(("batch", "seq"), WORKLOADS)
def test_forward_activation_peak_matches_cuda(batch: int, seq: int) -> None:
    """The memory model's forward peak is within 10% of max_memory_allocated's."""
    traced, gm, real, inputs = _traced_and_real(batch, seq)
    predicted = _forward_peak_prediction(traced)
    measured = _measured_forward_peak(gm, real, inputs)
    print(
        f"forward peak B{batch} S{seq}: predicted {predicted / 2**20:.1f} MiB, "
        f"measured {measured / 2**20:.1f} MiB"
    )
    assert abs(predicted - measured) <= 0.10 * measured


@pytest.mark.parametrize(("batch", "seq"), WORKLOADS)
def test_saved_bytes_match_cuda_hook_count(batch: int, seq: int) -> None:
    traced, gm, real, inputs = _traced_and_real(batch, seq)
    excluded = [*real.parameters(), *real.buffers()]
    with torch.enable_grad():
        measured, out = hook_counted_saved_bytes(lambda: gm(**inputs), excluded)
    del out
    print(
        f"saved B{batch} S{seq}: predicted {traced.saved_bytes / 2**20:.1f} MiB, "
        f"measured {measured / 2**20:.1f} MiB"
    )
    assert abs(traced.saved_bytes - measured) <= 0.05 * measured


def test_fused_gelu_saves_what_the_trace_predicts_on_cuda() -> None:
    """``trace(fuse_gelu=True)`` at 8 x 1024: CUDA's hook-counted saved bytes are within 5%
    of the fused trace's prediction, and below the written-out form's by about three
    (tokens, 4 * hidden) fp16 activations a layer."""
    batch, seq = 8, 1024
    traced, gm, real, inputs = _traced_and_real(batch, seq, fuse_gelu=True)
    assert len(traced.fused_gelu) == GPT2_SIZES["gpt2_medium"][1]
    excluded = [*real.parameters(), *real.buffers()]
    with torch.enable_grad():
        measured, out = hook_counted_saved_bytes(lambda: gm(**inputs), excluded)
    del out
    _, plain_gm, plain_real, plain_inputs = _traced_and_real(batch, seq)
    with torch.enable_grad():
        plain, out = hook_counted_saved_bytes(
            lambda: plain_gm(**plain_inputs), [*plain_real.parameters(), *plain_real.buffers()]
        )
    del out
    hidden, layers, _ = GPT2_SIZES["gpt2_medium"]
    three = 3 * layers * batch * seq * 4 * hidden * 2
    print(
        f"saved with fused GELU: predicted {traced.saved_bytes / 2**20:.1f} MiB, measured "
        f"{measured / 2**20:.1f} MiB; written out {plain / 2**20:.1f} MiB"
    )
    assert abs(traced.saved_bytes - measured) <= 0.05 * measured
    assert abs((plain - measured) - three) <= 0.05 * three


@pytest.mark.parametrize(("batch", "seq"), WORKLOADS)
def test_training_step_peak_matches_cuda(batch: int, seq: int) -> None:
    """Forward and backward under the memory model peak within 10% of CUDA's.

    Parameter gradients are dropped as they are accumulated, because the solver accounts
    them per region, outside the profile.
    """
    traced, gm, real, inputs = _traced_and_real(batch, seq)
    profile = traced.to_profile()
    predicted = 0
    saved = 0
    for op in profile.operations:
        predicted = max(predicted, saved + op.fwd_out_bytes + op.fwd_tmp_bytes)
        saved += op.saved_bytes
    for op in reversed(profile.operations):
        predicted = max(predicted, saved + op.bwd_out_bytes + op.bwd_tmp_bytes)
        saved -= op.saved_bytes
    _warm_up(gm, real, inputs)
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in real.parameters()
    ]
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.enable_grad():
        out = gm(**inputs)
    out.backward(torch.zeros_like(out))
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    for h in hooks:
        h.remove()
    print(
        f"step peak B{batch} S{seq}: predicted {predicted / 2**20:.1f} MiB, "
        f"measured {measured / 2**20:.1f} MiB"
    )
    assert abs(predicted - measured) <= 0.10 * measured


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "attention_mask"])
def test_head_dim_50_forward_peak_matches_cuda(with_mask: bool) -> None:
    """gpt2_xl's head dim (50) at sequence 1024, fp16, dropout 0.1.

    Without an attention_mask input the causal-attention pass leaves no mask, so CUDA runs
    flash attention (head dim padded to 56): predicted within 10%. With one, no fused
    kernel takes a mask at head dim 50 and CUDA runs the math path; the meta run's math
    path keeps a float32 dropout noise tensor where CUDA keeps a one-byte mask, so the
    prediction may be higher (about 12 vs 9 bytes per attention-matrix element), never
    lower.
    """
    hidden, layers, heads, batch, seq = 400, 2, 8, 8, 1024
    with torch.device("meta"):
        meta_model = gpt2(hidden, layers, heads, vocab=VOCAB, positions=seq)
    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        real = gpt2(hidden, layers, heads, vocab=VOCAB, positions=seq).half()
    ids = torch.randint(0, VOCAB, (batch, seq), device=device)
    meta_ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    if with_mask:
        meta_inputs = {"input_ids": meta_ids, "attention_mask": meta_ids}
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        meta_model, real = IdsOnly(meta_model.lm), IdsOnly(real.lm)
        meta_inputs, inputs = {"input_ids": meta_ids}, {"input_ids": ids}
    traced = trace(meta_model, meta_inputs, dtype=torch.float16, target_device="cuda")
    assert len(traced.causal_attention) == (0 if with_mask else layers)
    predicted = _forward_peak_prediction(traced)
    gm = assign_real(traced.module_for(device), real)
    measured = _measured_forward_peak(gm, real, inputs)
    print(
        f"head dim 50 forward peak ({'mask' if with_mask else 'no mask'}): predicted "
        f"{predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB"
    )
    if with_mask:
        assert 0.95 * measured <= predicted <= 1.45 * measured
    else:
        assert abs(predicted - measured) <= 0.10 * measured


def test_causal_rewrite_applies_to_a_model_on_the_gpu() -> None:
    """The causal mask's constants of a CUDA-resident model are evaluated on the CPU too:
    the pass compares the mask with its CPU pattern, which a CUDA mask would make raise."""
    layers = 2
    with torch.device("cuda"):
        model = IdsOnly(gpt2(64, layers, 4, vocab=VOCAB, positions=128).lm).half()
    ids = torch.randint(0, VOCAB, (2, 128), device="cuda")
    traced = trace(model, {"input_ids": ids}, dtype=torch.float16, target_device="cuda")
    assert len(traced.causal_attention) == layers
