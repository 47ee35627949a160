"""Small models and measuring helpers shared by the offload-trace tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

# Reference GPT-2 sizes of the project: (hidden, layers, heads).
GPT2_SIZES: dict[str, tuple[int, int, int]] = {
    "gpt2_medium": (1024, 24, 16),
    "gpt2_xl": (1600, 48, 32),
    "gpt2_10b": (4096, 50, 16),
    "gpt2_14b": (4096, 70, 16),
    "gpt2_20b": (8192, 25, 16),
    "gpt2_24b": (8192, 30, 16),
}
VOCAB = 1024


class LogitsOnly(nn.Module):
    """``forward(input_ids, attention_mask) -> logits`` around a Hugging Face LM."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits  # type: ignore[no-any-return]


class IdsOnly(nn.Module):
    """``forward(input_ids) -> logits``: no attention mask, so the model masks causally."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits  # type: ignore[no-any-return]


def _quiet(fn: Callable[[], nn.Module]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def gpt2(
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    *,
    vocab: int = 128,
    positions: int = 64,
    dropout: float = 0.1,
) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LogitsOnly(_quiet(lambda: GPT2LMHeadModel(cfg)))


def gpt2_reference(name: str, seq: int = 8) -> nn.Module:
    """A reference GPT-2 size built on the meta device (no weights allocated)."""
    hidden, layers, heads = GPT2_SIZES[name]
    with torch.device("meta"):
        return gpt2(hidden, layers, heads, vocab=VOCAB, positions=max(1024, seq), dropout=0.1)


def bert(dropout: float = 0.1) -> nn.Module:
    from transformers import BertConfig, BertLMHeadModel

    cfg = BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        is_decoder=True,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return LogitsOnly(_quiet(lambda: BertLMHeadModel(cfg)))


def llama(dropout: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        attention_dropout=dropout,
    )
    return LogitsOnly(_quiet(lambda: LlamaForCausalLM(cfg)))


class ThreeWayTied(nn.Module):
    """One weight used by three linear layers, plus a batch norm and a plain buffer."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(width, width, bias=False)
        self.second = nn.Linear(width, width, bias=False)
        self.third = nn.Linear(width, width, bias=False)
        self.second.weight = self.first.weight
        self.third.weight = self.first.weight
        self.norm = nn.BatchNorm1d(width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.second(self.first(x))))
        return self.third(self.drop(h)) * self.scale


def token_inputs(batch: int, seq: int, vocab: int = 128) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def assign_real(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """Put ``model``'s real parameters and buffers into ``gm`` along the original names."""
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in named:
        *path, last = name.split(".")
        owner: Any = gm
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, last, tensor)
    return gm


def hook_counted_saved_bytes(
    run: Callable[[], Any], excluded: list[torch.Tensor]
) -> tuple[int, Any]:
    """Bytes autograd saves during ``run()``: storages once, ``excluded`` storages left out."""
    skip = {t.untyped_storage().data_ptr() for t in excluded}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        # Detached: a saved output returned as is would hold its own grad_fn, a cycle that
        # Python's collector cannot see through, and the whole graph would outlive the run.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
