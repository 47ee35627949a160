"""Tiny models shared by the runtime tests (dropout off, so runs are deterministic)."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertLMHeadModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

VOCAB = 96


class LogitsOnly(torch.nn.Module):
    """``forward(input_ids, attention_mask) -> logits`` around a Hugging Face model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits  # type: ignore[no-any-return]


def tiny_gpt2(layers: int = 3) -> torch.nn.Module:
    cfg = GPT2Config(
        n_embd=32,
        n_layer=layers,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LogitsOnly(GPT2LMHeadModel(cfg))


def tiny_bert() -> torch.nn.Module:
    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        is_decoder=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return LogitsOnly(BertLMHeadModel(cfg))


def tiny_llama() -> torch.nn.Module:
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LogitsOnly(LlamaForCausalLM(cfg))


class ThreeWayTied(torch.nn.Module):
    """One weight used in three places: input embedding, a middle projection, the head."""

    def __init__(self, dim: int = 16, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mid = torch.nn.Linear(dim, vocab, bias=False)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
            )
            for _ in range(3)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.mid.weight = self.embed.weight
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h) * self.scale
        mixed = torch.softmax(self.mid(h), dim=-1) @ self.embed.weight
        h = self.norm(h + mixed) * attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head(h)  # type: ignore[no-any-return]


def inputs(batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)}


def loss_of(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Shifted next-token cross-entropy in fp32."""
    shift = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(shift, input_ids[:, 1:].reshape(-1))
