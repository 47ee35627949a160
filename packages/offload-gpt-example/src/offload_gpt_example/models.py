"""GPT-2 and Llama model zoo, LM loss and random data for the offload example.

The GPT-2 sizes are the reference example's (Colossal-AI ``auto_offload``), plus
``gpt2_tiny`` for machines without a GPU and ``gpt2_6b`` for the benchmarks. Every GPT-2
model uses a vocabulary of 1024 tokens, like the reference, so that the embedding and LM
head stay a small share of the parameters and the transformer blocks dominate.

``llama_3b`` is a current architecture (transformers' ``LlamaForCausalLM``: rotary
position embeddings, grouped-query attention through SDPA, RMSNorm, a SiLU-gated MLP,
untied embedding and LM head, Llama's 32000-token vocabulary), and ``llama_tiny`` its
shape at the size of a CPU test. Every model is built and called alike (:func:`build_model`;
``forward(input_ids, attention_mask=None) -> logits``).

Big models are built without a full fp32 copy: on the meta device for planning
(:func:`build_model` with ``device="meta"``), or on the meta device and then materialised
directly in the training dtype on the CPU, where the weights are initialised with GPT-2's
scheme (normal(0, 0.02), residual projections scaled by ``1/sqrt(2 * n_layer)``) or
Llama's (normal(0, 0.02), RMSNorm weights 1).
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

VOCAB_SIZE = 1024
"""Tokens in the vocabulary of every model in the zoo (the reference's value)."""
DEFAULT_SEQ_LEN = 8
"""Sequence length of the reference's random data."""
DEFAULT_N_POSITIONS = 1024
"""Position-embedding rows when the sequence is shorter (GPT-2's value)."""
HF_DEFAULT_DROPOUT = 0.1
"""Hugging Face's ``resid_pdrop`` / ``embd_pdrop`` / ``attn_pdrop`` default (GPT-2's)."""
LLAMA_DEFAULT_DROPOUT = 0.0
"""Hugging Face's ``attention_dropout`` default for Llama (its only dropout)."""
LLAMA_ACTIVATION = "silu"
"""Llama's MLP activation (the gate of its SiLU-gated MLP)."""
DEFAULT_LLAMA_POSITIONS = 2048
"""Llama's ``max_position_embeddings`` when the sequence is shorter (HF's default)."""
DEFAULT_ACTIVATION = "gelu_new"
"""GPT-2's own MLP activation: the tanh GELU written out (transformers'
``NewGELUActivation``)."""


@dataclass(frozen=True)
class GPTSpec:
    """The shape of one model in the zoo."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary (:data:`VOCAB_SIZE`)."""
        return VOCAB_SIZE

    @property
    def approx_numel(self) -> int:
        """Parameter count at the default 1024 positions (tied embedding counted once)."""
        h, layers = self.hidden_size, self.num_layers
        per_block = 12 * h * h + 13 * h
        return layers * per_block + (VOCAB_SIZE + DEFAULT_N_POSITIONS) * h + 2 * h


@dataclass(frozen=True)
class LlamaSpec:
    """The shape of one Llama model in the zoo (transformers' ``LlamaConfig``)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def approx_numel(self) -> int:
        """Parameter count: the untied embedding and LM head, no biases, two RMSNorm
        weights a layer and a final one."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


ModelSpec = GPTSpec | LlamaSpec
"""A zoo entry of either family."""

_REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        GPTSpec("gpt2_micro", hidden_size=64, num_layers=2, num_heads=4),
        GPTSpec("gpt2_tiny", hidden_size=128, num_layers=4, num_heads=4),
        GPTSpec("gpt2_medium", hidden_size=1024, num_layers=24, num_heads=16),
        GPTSpec("gpt2_xl", hidden_size=1600, num_layers=48, num_heads=32),
        GPTSpec("gpt2_6b", hidden_size=4096, num_layers=30, num_heads=16),
        GPTSpec("gpt2_10b", hidden_size=4096, num_layers=50, num_heads=16),
        GPTSpec("gpt2_14b", hidden_size=4096, num_layers=70, num_heads=16),
        GPTSpec("gpt2_20b", hidden_size=8192, num_layers=25, num_heads=16),
        GPTSpec("gpt2_24b", hidden_size=8192, num_layers=30, num_heads=16),
        LlamaSpec(
            "llama_tiny",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=1024,
        ),
        LlamaSpec(
            "llama_3b",
            hidden_size=3072,
            num_layers=28,
            num_heads=24,
            num_kv_heads=8,
            intermediate_size=8192,
            vocab_size=32000,
        ),
    )
}


def model_names() -> tuple[str, ...]:
    """Names of the registered models: GPT-2's smallest first, then Llama's."""
    return tuple(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The spec registered as ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(_REGISTRY)
        raise ValueError(f"Model {name!r} is not registered; known: {known}") from None


class LMModel(nn.Module, abc.ABC):
    """A zoo model: ``forward(input_ids, attention_mask=None) -> logits`` over a Hugging
    Face causal LM (``self.model``), its KV cache off. Training never reuses the cache,
    and a cache output would be one more tensor for the tracer to follow."""

    config: GPT2Config | LlamaConfig
    model: nn.Module

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)`` in the parameters' dtype."""
        if attention_mask is None:
            out = self.model(input_ids=input_ids, use_cache=False)
        else:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits: torch.Tensor = out.logits
        return logits

    @abc.abstractmethod
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks (decoder layers), in order: the units FSDP shards."""


class GPTLMModel(LMModel):
    """Hugging Face ``GPT2LMHeadModel`` as ``forward(input_ids, attention_mask=None) -> logits``.

    Without an ``attention_mask`` (the example's batches: packed sequences, no padding)
    the traced graph's attention is plain causal attention, which offload-trace turns into
    ``is_causal=True`` so that CUDA's fused kernels apply; an explicit all-ones mask means
    the same but keeps a mask tensor in the graph, which at some head sizes (gpt2_xl's 50)
    sends attention down the O(S^2) math path.
    """

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.model: GPT2LMHeadModel = GPT2LMHeadModel(config)

    def blocks(self) -> nn.ModuleList:
        h: nn.ModuleList = self.model.transformer.h
        return h


class LlamaLMModel(LMModel):
    """Hugging Face ``LlamaForCausalLM`` as ``forward(input_ids, attention_mask=None) ->
    logits``, attention through SDPA (grouped-query where the spec has fewer key-value
    heads than query heads)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model: LlamaForCausalLM = LlamaForCausalLM(config)

    def blocks(self) -> nn.ModuleList:
        layers: nn.ModuleList = self.model.model.layers
        return layers


def gpt2_config(
    spec: GPTSpec,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    dropout: float = HF_DEFAULT_DROPOUT,
    activation: str = DEFAULT_ACTIVATION,
) -> GPT2Config:
    """The ``GPT2Config`` of ``spec``; ``dropout`` sets all three HF dropout rates and
    ``activation`` the MLP's (a key of transformers' ``ACT2FN``: GPT-2's ``"gelu_new"``,
    its tanh GELU written out in eight operations, or ``"gelu_pytorch_tanh"``, the same
    function as one ``aten.gelu``)."""
    _check_shape(seq_len, dropout, activation)
    return GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=max(DEFAULT_N_POSITIONS, seq_len),
        n_embd=spec.hidden_size,
        n_layer=spec.num_layers,
        n_head=spec.num_heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        activation_function=activation,
        use_cache=False,
        # GPT-2's 50256 lies outside the 1024-token vocabulary; these ids are never used.
        bos_token_id=None,
        eos_token_id=None,
    )


def _check_shape(seq_len: int, dropout: float, activation: str) -> None:
    if activation not in ACT2FN:
        raise ValueError(
            f"activation {activation!r} is not one of transformers' activations; "
            f"use {DEFAULT_ACTIVATION!r} or 'gelu_pytorch_tanh' (GPT-2), "
            f"{LLAMA_ACTIVATION!r} (Llama)"
        )
    if seq_len <= 0:
        raise ValueError(f"seq_len is {seq_len}; it must be a positive number of tokens")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout is {dropout}; use a probability in [0, 1)")


def llama_config(
    spec: LlamaSpec,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    dropout: float = LLAMA_DEFAULT_DROPOUT,
    activation: str = LLAMA_ACTIVATION,
) -> LlamaConfig:
    """The ``LlamaConfig`` of ``spec``: SDPA attention, no KV cache, the embedding and LM
    head untied; ``dropout`` is the attention's (Llama's only dropout), ``activation`` the
    MLP gate's."""
    _check_shape(seq_len, dropout, activation)
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        hidden_act=activation,
        max_position_embeddings=max(DEFAULT_LLAMA_POSITIONS, seq_len),
        initializer_range=0.02,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        use_cache=False,
    )
    # Set, not left to the model's choice: the traced and the eager attention are SDPA.
    config._attn_implementation = "sdpa"
    return config


def build_model(
    name: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float16,
    seq_len: int = DEFAULT_SEQ_LEN,
    dropout: float | None = None,
    seed: int | None = 0,
    init_device: torch.device | str | None = None,
    activation: str | None = None,
) -> LMModel:
    """Build zoo model ``name`` with parameters of ``dtype`` on ``device``.

    ``device="meta"`` allocates nothing (for planning any size on any machine). Otherwise
    the model is created on meta and materialised directly in ``dtype`` on ``device``, so
    that a 24B-parameter model never needs an fp32 copy (96 GB) on the host.
    ``seed`` makes the initial weights reproducible (``None`` leaves the global RNG alone).
    ``init_device`` draws the random weights there, one parameter at a time, and copies
    them to ``device``: torch's CPU ``normal_`` is single-threaded (about a minute for
    gpt2_xl's 1.5 B parameters), a GPU draws them in milliseconds. Default:
    ``device``. ``dropout`` and ``activation`` default to the family's (GPT-2: 0.1 and
    ``"gelu_new"``, :func:`gpt2_config`; Llama: 0 and ``"silu"``, :func:`llama_config`).
    """
    spec = get_spec(name)
    if not dtype.is_floating_point:
        raise ValueError(
            f"dtype {dtype} is not a floating-point type; use float16/bfloat16/float32"
        )
    if isinstance(spec, LlamaSpec):
        return _build_llama(
            spec,
            device=device,
            dtype=dtype,
            seq_len=seq_len,
            dropout=LLAMA_DEFAULT_DROPOUT if dropout is None else dropout,
            seed=seed,
            init_device=init_device,
            activation=LLAMA_ACTIVATION if activation is None else activation,
        )
    config = gpt2_config(
        spec,
        seq_len=seq_len,
        dropout=HF_DEFAULT_DROPOUT if dropout is None else dropout,
        activation=DEFAULT_ACTIVATION if activation is None else activation,
    )
    with torch.device("meta"):
        model = GPTLMModel(config)
    model = model.to(dtype=dtype)
    dev = torch.device(device)
    if dev.type == "meta":
        return model
    model = model.to_empty(device=dev)
    # to_empty gives the LM head its own storage; re-tie it to the token embedding.
    model.model.tie_weights()
    init_gpt2_weights(model, num_layers=spec.num_layers, seed=seed, init_device=init_device)
    return model


def _build_llama(
    spec: LlamaSpec,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    seq_len: int,
    dropout: float,
    seed: int | None,
    init_device: torch.device | str | None,
    activation: str,
) -> LlamaLMModel:
    """:func:`build_model` for a Llama spec. The rotary embedding's inverse frequencies
    (buffers, not parameters) are computed again in fp32 on ``device`` after the cast to
    ``dtype``: ``to_empty`` leaves them unset, and fp16 would round them."""
    config = llama_config(spec, seq_len=seq_len, dropout=dropout, activation=activation)
    with torch.device("meta"):
        model = LlamaLMModel(config)
    model = model.to(dtype=dtype)
    dev = torch.device(device)
    if dev.type != "meta":
        model = model.to_empty(device=dev)
        init_llama_weights(model, seed=seed, init_device=init_device)
    with torch.device("meta" if dev.type == "meta" else "cpu"):
        rotary = LlamaRotaryEmbedding(config)
    model.model.model.rotary_emb = rotary.to(dev)
    return model


def _draw_normal(
    p: torch.Tensor, std: float, draw_on: torch.device, gen: torch.Generator | None
) -> None:
    """``p ~ normal(0, std)``, drawn on ``draw_on`` (a hidden copy to ``p`` if elsewhere)."""
    if p.device == draw_on:
        p.normal_(0.0, std, generator=gen)
    else:
        # A hidden copy (device to pageable host memory): one parameter at a time.
        drawn = torch.empty(p.shape, dtype=p.dtype, device=draw_on)
        p.copy_(drawn.normal_(0.0, std, generator=gen))


def _draw_setup(
    params: dict[str, nn.Parameter],
    seed: int | None,
    init_device: torch.device | str | None,
) -> tuple[torch.device, torch.Generator | None]:
    first = next(iter(params.values()))
    draw_on = torch.device(init_device) if init_device is not None else first.device
    gen: torch.Generator | None = None
    if seed is not None:
        gen = torch.Generator(device=draw_on)
        gen.manual_seed(seed)
    return draw_on, gen


@torch.no_grad()
def init_llama_weights(
    model: nn.Module,
    *,
    seed: int | None = 0,
    init_device: torch.device | str | None = None,
    std: float = 0.02,
) -> None:
    """Hugging Face's Llama initialisation, in place, in the parameters' own dtype:
    matrices and embeddings ~ normal(0, ``std``), RMSNorm weights 1 (Llama has no biases).
    Drawn on ``init_device`` as :func:`init_gpt2_weights` draws."""
    params = dict(model.named_parameters())
    if not params:
        return
    draw_on, gen = _draw_setup(params, seed, init_device)
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            _draw_normal(p, std, draw_on, gen)


@torch.no_grad()
def init_gpt2_weights(
    model: nn.Module,
    *,
    num_layers: int,
    seed: int | None = 0,
    init_device: torch.device | str | None = None,
) -> None:
    """GPT-2's initialisation, in place, in the parameters' own dtype.

    Matrices and embeddings ~ normal(0, 0.02); the residual projections ``c_proj`` ~
    normal(0, 0.02 / sqrt(2 * num_layers)); biases 0; LayerNorm weights 1. Random values
    are drawn on ``init_device`` (default: where the parameters are) and copied over one
    parameter at a time, so at most one parameter's worth of memory is used there.
    """
    params = dict(model.named_parameters())  # tied parameters are listed (and set) once
    if not params:
        return
    draw_on, gen = _draw_setup(params, seed, init_device)
    std = 0.02
    for name, p in params.items():
        leaf = name.rsplit(".", 2)
        if name.endswith(".bias"):
            p.zero_()
        elif len(leaf) >= 2 and leaf[-2].startswith("ln_"):
            p.fill_(1.0)
        else:
            p_std = std / math.sqrt(2 * num_layers) if name.endswith("c_proj.weight") else std
            _draw_normal(p, p_std, draw_on, gen)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, tied storage counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position ``t`` predicts label ``t + 1``, computed in fp32.

    The logits are upcast before the softmax because fp16/bf16 log-sum-exp over the
    vocabulary loses most of the loss's precision.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match labels of shape "
            f"{tuple(labels.shape)}; labels must be (batch, seq)"
        )
    shift_logits = logits[..., :-1, :].float()
    shift_labels = labels[..., 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1)
    )


class WithLMLoss(nn.Module):
    """``model`` followed by :func:`lm_loss`: its forward returns the loss, not the logits.

    Plan this module, not ``model``: the planner prices only what the module it traces
    computes, and at long sequences the loss is among the largest parts of a step (its fp32
    logits and their log-softmax, 8 bytes per logit, can exceed the model's own
    activations). Labels default to the batch's own ``input_ids`` (:func:`labels_for`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(input_ids=input_ids)
        return lm_loss(logits, input_ids if labels is None else labels)


def random_batch(
    batch_size: int,
    seq_len: int = DEFAULT_SEQ_LEN,
    *,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
    vocab_size: int = VOCAB_SIZE,
) -> dict[str, torch.Tensor]:
    """Random ``input_ids`` in ``[0, vocab_size)`` (default the GPT-2 models' 1024; a
    model's own is ``get_spec(name).vocab_size``), int64: no padding, so no attention
    mask."""
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(
            f"batch_size={batch_size} and seq_len={seq_len} must both be positive integers"
        )
    dev = torch.device(device)
    if dev.type == "meta":
        input_ids = torch.empty(batch_size, seq_len, dtype=torch.long, device=dev)
    else:
        input_ids = torch.randint(
            0, vocab_size, (batch_size, seq_len), device=dev, generator=generator
        )
    return {"input_ids": input_ids}


def labels_for(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Labels for a batch: its own ``input_ids``, so their shape always matches the batch."""
    return batch["input_ids"]


__all__ = [
    "DEFAULT_SEQ_LEN",
    "HF_DEFAULT_DROPOUT",
    "VOCAB_SIZE",
    "GPTLMModel",
    "GPTSpec",
    "LMModel",
    "LlamaLMModel",
    "LlamaSpec",
    "ModelSpec",
    "WithLMLoss",
    "build_model",
    "get_spec",
    "gpt2_config",
    "init_gpt2_weights",
    "init_llama_weights",
    "labels_for",
    "llama_config",
    "lm_loss",
    "model_names",
    "parameter_bytes",
    "random_batch",
]
