"""The zoo's Llama models: shapes, construction, initialisation and the call the benchmark
and the planner make (``module(**batch) -> logits``)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from offload_gpt_example.models import (
    LLAMA_DEFAULT_DROPOUT,
    LlamaLMModel,
    LlamaSpec,
    build_model,
    get_spec,
    labels_for,
    llama_config,
    lm_loss,
    model_names,
    random_batch,
)

LLAMA_3B = (3072, 28, 24, 8, 8192, 32000)


def test_llama_3b_is_the_issues_shape() -> None:
    assert {"llama_tiny", "llama_3b"} <= set(model_names())
    spec = get_spec("llama_3b")
    assert isinstance(spec, LlamaSpec)
    shape = (
        spec.hidden_size,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_size,
        spec.vocab_size,
    )
    assert shape == LLAMA_3B
    assert 2.9e9 < spec.approx_numel < 3.1e9


@pytest.mark.parametrize("name", ["llama_tiny", "llama_3b"])
def test_meta_build_is_sdpa_llama_with_grouped_query_attention(name: str) -> None:
    model = build_model(name, device="meta", dtype=torch.float16, seq_len=2048)
    assert isinstance(model, LlamaLMModel)
    assert isinstance(model.model, LlamaForCausalLM)
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.float16 for p in params)
    assert sum(p.numel() for p in params) == get_spec(name).approx_numel
    cfg = model.config
    spec = get_spec(name)
    assert cfg._attn_implementation == "sdpa"
    assert cfg.num_key_value_heads == spec.num_kv_heads < cfg.num_attention_heads  # type: ignore[union-attr]
    assert not cfg.tie_word_embeddings and not cfg.use_cache
    assert model.model.lm_head.weight is not model.model.model.embed_tokens.weight
    assert len(model.blocks()) == spec.num_layers
    assert cfg.max_position_embeddings >= 2048
    # The rotary frequencies are fp32 buffers whatever the training dtype.
    assert model.model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_llama_defaults_and_checks() -> None:
    spec = get_spec("llama_tiny")
    assert isinstance(spec, LlamaSpec)
    cfg = llama_config(spec)
    assert cfg.attention_dropout == LLAMA_DEFAULT_DROPOUT and cfg.hidden_act == "silu"
    with pytest.raises(ValueError, match=r"dropout is 1\.5"):
        llama_config(spec, dropout=1.5)
    with pytest.raises(ValueError, match="not one of transformers' activations"):
        build_model("llama_tiny", device="meta", activation="swish_typo")


def test_llama_initialisation_follows_hugging_face_and_is_seeded() -> None:
    a = build_model("llama_tiny", dtype=torch.float32, seed=3)
    b = build_model("llama_tiny", dtype=torch.float32, seed=3)
    c = build_model("llama_tiny", dtype=torch.float32, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    params = dict(a.named_parameters())
    assert not torch.equal(
        params["model.lm_head.weight"], dict(c.named_parameters())["model.lm_head.weight"]
    )
    for name, p in params.items():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert p.std().item() == pytest.approx(0.02, rel=0.1), name
    # The rotary frequencies are computed, not left as to_empty's garbage.
    fresh = LlamaForCausalLM(a.config).model.rotary_emb.inv_freq
    assert torch.equal(a.model.model.rotary_emb.inv_freq, fresh)


def test_llama_forward_and_loss_as_the_benchmark_calls_them() -> None:
    model = build_model("llama_tiny", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    vocab = get_spec("llama_tiny").vocab_size
    batch = random_batch(3, 16, generator=gen, vocab_size=vocab)
    logits = model(**batch)
    assert logits.shape == (3, 16, vocab)
    loss = lm_loss(logits, labels_for(batch))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    # An all-ones mask means the same as none (packed sequences, no padding).
    with torch.no_grad():
        masked = model(**batch, attention_mask=torch.ones_like(batch["input_ids"]))
    torch.testing.assert_close(masked, logits.detach())


def test_random_batch_follows_the_vocabulary() -> None:
    batch = random_batch(4, 64, generator=torch.Generator().manual_seed(1), vocab_size=32000)
    assert int(batch["input_ids"].max()) >= 1024
    assert int(batch["input_ids"].max()) < 32000


def test_llama_3b_at_w5_plans_on_the_default_gpu_profile() -> None:
    """llama_3b at 2 x 2048 under 24 GiB (the benchmark's W5) traces and plans on meta
    for the default GPU: a plan that offloads, inside the budget. At 4 x 2048 the
    activations alone exceed it: the planner recomputes or moves some, and without that
    lever (``PlanForce(activations=False)``) names a least budget above it."""
    from offload_runtime import PlanForce, plan
    from offload_runtime.planning import plan_model
    from offload_solver import ActivationPlacement, InfeasibleBudgetError, default_hardware

    model = build_model("llama_3b", device="meta", dtype=torch.float16, seq_len=2048)
    vocab = get_spec("llama_3b").vocab_size
    budget = 24 << 30
    kwargs = {"hardware": default_hardware(), "device": "cuda", "progress": False}
    found = plan(
        model, random_batch(2, 2048, device="meta", vocab_size=vocab), budget, "asyn", **kwargs
    )  # type: ignore[arg-type]
    assert found.predicted_peak_bytes <= budget
    assert len(found.regions) > 1
    batch4 = random_batch(4, 2048, device="meta", vocab_size=vocab)
    moved = plan(model, batch4, budget, "asyn", **kwargs)  # type: ignore[arg-type]
    assert moved.predicted_peak_bytes <= budget
    assert any(rp.activations is not ActivationPlacement.KEEP for rp in moved.regions)
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_model(model, batch4, budget, "asyn", force=PlanForce(activations=False), **kwargs)  # type: ignore[arg-type]
    assert info.value.least_budget_bytes > budget
