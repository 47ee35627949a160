"""The model zoo: shapes and sizes, in-dtype construction, the LM loss and random data."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from offload_gpt_example.models import (
    HF_DEFAULT_DROPOUT,
    VOCAB_SIZE,
    build_model,
    get_spec,
    gpt2_config,
    labels_for,
    lm_loss,
    model_names,
    parameter_bytes,
    random_batch,
)

REFERENCE_SIZES = {
    "gpt2_medium": (1024, 24, 16),
    "gpt2_xl": (1600, 48, 32),
    "gpt2_10b": (4096, 50, 16),
    "gpt2_14b": (4096, 70, 16),
    "gpt2_20b": (8192, 25, 16),
    "gpt2_24b": (8192, 30, 16),
    "gpt2_6b": (4096, 30, 16),
}


def test_registry_has_the_reference_sizes_and_tiny() -> None:
    names = model_names()
    assert "gpt2_tiny" in names
    for name, (hidden, layers, heads) in REFERENCE_SIZES.items():
        spec = get_spec(name)
        assert (spec.hidden_size, spec.num_layers, spec.num_heads) == (hidden, layers, heads)


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"Model 'gpt3' is not registered; known: ") as info:
        get_spec("gpt3")
    for name in model_names():
        assert name in str(info.value)


@pytest.mark.parametrize("name", sorted(REFERENCE_SIZES))
def test_meta_build_matches_the_spec_without_allocating(name: str) -> None:
    model = build_model(name, device="meta", dtype=torch.float16)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert all(p.dtype == torch.float16 for p in params)
    # parameters() lists the tied wte / lm_head storage once.
    assert sum(p.numel() for p in params) == get_spec(name).approx_numel
    cfg = model.config
    assert cfg.vocab_size == VOCAB_SIZE
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head) == REFERENCE_SIZES[name]


def test_positions_cover_the_sequence() -> None:
    assert gpt2_config(get_spec("gpt2_tiny"), seq_len=8).n_positions >= 8
    assert gpt2_config(get_spec("gpt2_tiny"), seq_len=4096).n_positions == 4096


def test_dropout_is_configurable_and_defaults_to_hugging_faces() -> None:
    spec = get_spec("gpt2_tiny")
    default = gpt2_config(spec)
    assert (default.resid_pdrop, default.embd_pdrop, default.attn_pdrop) == (
        HF_DEFAULT_DROPOUT,
    ) * 3
    off = gpt2_config(spec, dropout=0.0)
    assert (off.resid_pdrop, off.embd_pdrop, off.attn_pdrop) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"dropout is 1\.5"):
        gpt2_config(spec, dropout=1.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_build_is_in_the_training_dtype_with_tied_head(dtype: torch.dtype) -> None:
    model = build_model("gpt2_tiny", dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not any(p.is_meta for p in model.parameters())
    hf = model.model
    assert hf.lm_head.weight is hf.transformer.wte.weight
    assert parameter_bytes(model) == get_spec("gpt2_tiny").approx_numel * dtype.itemsize


def test_initialisation_follows_gpt2_and_is_seeded() -> None:
    a = build_model("gpt2_tiny", dtype=torch.float32, seed=3)
    b = build_model("gpt2_tiny", dtype=torch.float32, seed=3)
    c = build_model("gpt2_tiny", dtype=torch.float32, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.transformer.wte.weight, c.model.transformer.wte.weight)
    params = dict(a.named_parameters())
    block = "model.transformer.h.0."
    layers = get_spec("gpt2_tiny").num_layers
    assert params[block + "attn.c_attn.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params[block + "attn.c_proj.weight"].std().item() == pytest.approx(
        0.02 / math.sqrt(2 * layers), rel=0.1
    )
    assert torch.all(params[block + "ln_1.weight"] == 1)
    assert torch.all(params[block + "ln_1.bias"] == 0)
    assert torch.all(params[block + "mlp.c_fc.bias"] == 0)


def test_forward_returns_logits_for_every_position() -> None:
    model = build_model("gpt2_tiny", dtype=torch.float32, dropout=0.0)
    batch = random_batch(3, 5)
    logits = model(**batch)
    assert logits.shape == (3, 5, VOCAB_SIZE)
    # Dropout 0 in training mode: the forward is deterministic.
    assert torch.equal(logits, model(**batch))
    # An all-ones mask means the same as none (the traced graph is simpler without one).
    ones = torch.ones_like(batch["input_ids"])
    assert torch.allclose(logits, model(batch["input_ids"], ones), rtol=1e-5, atol=1e-6)


def test_the_fused_activation_is_gpt2s_gelu_and_the_operations_a_fused_trace_runs() -> None:
    """``activation="gelu_pytorch_tanh"`` (what the benchmark's peers run under
    BENCH_FUSE_GELU=1) computes GPT-2's tanh GELU to float32 rounding with the same seeded
    weights, and traces to exactly the operations and saved bytes that GPT-2's own model
    traces to with ``fuse_gelu=True``; a name transformers lacks is refused."""
    from offload_trace import trace

    plain = build_model("gpt2_tiny", dtype=torch.float32, dropout=0.0)
    tanh = build_model(
        "gpt2_tiny", dtype=torch.float32, dropout=0.0, activation="gelu_pytorch_tanh"
    )
    assert plain.model.config.activation_function == "gelu_new"
    batch = random_batch(2, 8)
    torch.testing.assert_close(tanh(**batch), plain(**batch), rtol=1e-5, atol=1e-5)

    fused = trace(plain, batch, dtype=torch.float16, target_device="cpu", fuse_gelu=True)
    peer = trace(tanh, batch, dtype=torch.float16, target_device="cpu")
    assert len(fused.fused_gelu) == get_spec("gpt2_tiny").num_layers
    assert peer.fused_gelu == ()
    assert len(peer.operation_names) == len(fused.operation_names)
    assert peer.saved_bytes == fused.saved_bytes
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        build_model("gpt2_tiny", device="meta", activation="gelu_tanh_typo")


def test_random_batch_and_labels_follow_the_requested_shape() -> None:
    gen = torch.Generator().manual_seed(0)
    batch = random_batch(6, 11, generator=gen)
    assert batch["input_ids"].shape == (6, 11)
    assert batch["input_ids"].dtype == torch.long
    assert int(batch["input_ids"].min()) >= 0 and int(batch["input_ids"].max()) < VOCAB_SIZE
    assert set(batch) == {"input_ids"}  # no padding: causal attention without a mask
    assert labels_for(batch).shape == (6, 11)
    meta = random_batch(64, 8, device="meta")
    assert meta["input_ids"].is_meta and meta["input_ids"].shape == (64, 8)
    with pytest.raises(ValueError, match="batch_size=0"):
        random_batch(0, 8)


def test_lm_loss_predicts_the_next_token_in_fp32() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 4, VOCAB_SIZE).half()
    labels = torch.randint(0, VOCAB_SIZE, (2, 4))
    loss = lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, VOCAB_SIZE), labels[:, 1:].reshape(-1)
    )
    assert torch.allclose(loss, expected)
    # Uniform logits: the loss is log(vocab) whatever the labels.
    uniform = lm_loss(torch.zeros(2, 4, VOCAB_SIZE), labels)
    assert uniform.item() == pytest.approx(math.log(VOCAB_SIZE), rel=1e-6)


def test_lm_loss_rejects_mismatched_labels() -> None:
    with pytest.raises(ValueError, match=r"labels of shape \(64, 8\)"):
        lm_loss(torch.zeros(4, 8, VOCAB_SIZE), torch.zeros(64, 8, dtype=torch.long))


@pytest.mark.gpu
def test_weights_drawn_on_the_gpu_land_on_the_cpu_with_gpt2_statistics() -> None:
    model = build_model("gpt2_xl", dtype=torch.float16, init_device="cuda")
    params = dict(model.named_parameters())
    assert {p.device.type for p in params.values()} == {"cpu"}
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    c_attn = params["model.transformer.h.0.attn.c_attn.weight"].float()
    assert c_attn.std().item() == pytest.approx(0.02, rel=0.01)
    c_proj = params["model.transformer.h.47.mlp.c_proj.weight"].float()
    assert c_proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 48), rel=0.01)
    assert torch.all(params["model.transformer.ln_f.weight"] == 1)
