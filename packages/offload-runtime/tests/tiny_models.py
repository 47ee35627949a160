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

from offload_solver import (
    HardwareProfile,
    InfeasibleBudgetError,
    ModelProfile,
    ParamPlacement,
    Plan,
    solve,
)
from offload_trace import trace

VOCAB = 96


class LogitsOnly(torch.nn.Module):
    """``forward(input_ids, attention_mask=None) -> logits`` around a Hugging Face model."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits  # type: ignore[no-any-return]


def tiny_gpt2(layers: int = 3) -> torch.nn.Module:
    return gpt2(32, layers, 4, vocab=VOCAB, positions=32)


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


def gpt2(
    hidden: int,
    layers: int,
    heads: int,
    *,
    vocab: int = 1024,
    positions: int = 1024,
    dropout: float = 0.0,
) -> torch.nn.Module:
    """A GPT-2 of the given shape, fp32 on the CPU, with every dropout at ``dropout`` (off
    by default)."""
    cfg = GPT2Config(
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LogitsOnly(GPT2LMHeadModel(cfg))


def least_budget(
    model: torch.nn.Module,
    inp: dict[str, torch.Tensor],
    solver: str,
    dtype: torch.dtype,
    hardware: HardwareProfile,
    *,
    fuse_gelu: bool = False,
) -> int:
    """The smallest budget the solver accepts (finest regions): it offloads all it can."""
    return _least_budget_of(_profile(model, inp, dtype, fuse_gelu), solver, hardware)


def _profile(
    model: torch.nn.Module, inp: dict[str, torch.Tensor], dtype: torch.dtype, fuse_gelu: bool
) -> ModelProfile:
    """``model``'s profile as ``memory_optimize`` traces it on this machine."""
    target = "cuda" if torch.cuda.is_available() else "cpu"
    return trace(model, inp, dtype=dtype, target_device=target, fuse_gelu=fuse_gelu).to_profile()


def _least_budget_of(profile: ModelProfile, solver: str, hardware: HardwareProfile) -> int:
    try:
        solve(profile, hardware, 1, solver=solver, block_search_range_bytes=0)
    except InfeasibleBudgetError as exc:
        return exc.least_budget_bytes
    raise AssertionError("a 1-byte budget was accepted")


def offloaded_half(plan: Plan, solver: str) -> bool:
    """At least half the regions with parameters offloaded (some async for ``asyn``)."""
    regions = [rp for rp in plan.regions if rp.region.numel > 0]
    offloaded = [rp for rp in regions if rp.placement is not ParamPlacement.RESIDENT]
    has_async = any(rp.placement is ParamPlacement.ASYNC for rp in offloaded)
    return len(offloaded) * 2 >= len(regions) and (solver == "syn" or has_async)


UPLOAD_STATS = ("sync_uploads", "prefetches", "prefetch_fallbacks")
"""The ``OffloadController.stats`` counters of parameter uploads."""


def uploads_per_step(plan: Plan) -> dict[str, int]:
    """The uploads one forward and backward of a module running ``plan`` makes, as
    ``OffloadController.stats`` counts them: each SYNC region uploaded on the compute
    stream before its forward and again before its backward, each ASYNC region prefetched
    on the H2D stream for both (at the points the plan gives), none falling back to an
    upload at use for want of its pool block."""
    sync = sum(rp.placement is ParamPlacement.SYNC for rp in plan.regions)
    asyn = sum(rp.placement is ParamPlacement.ASYNC for rp in plan.regions)
    return {"sync_uploads": 2 * sync, "prefetches": 2 * asyn, "prefetch_fallbacks": 0}


def forcing_budget(
    model: torch.nn.Module,
    inp: dict[str, torch.Tensor],
    solver: str,
    dtype: torch.dtype,
    hardware: HardwareProfile,
    *,
    fuse_gelu: bool = False,
) -> int:
    """The least budget above the infeasible one at which the plan offloads half the
    regions (with async prefetches for ``asyn``, which need a little room to coexist),
    for the model traced as the planner traces it with ``OffloadConfig(fuse_gelu=fuse_gelu)``."""
    profile = _profile(model, inp, dtype, fuse_gelu)
    least = _least_budget_of(profile, solver, hardware)
    for step in range(60):
        budget = int(least * (1 + 0.02 * step))
        plan = solve(profile, hardware, budget, solver=solver, block_search_range_bytes=0)
        if offloaded_half(plan, solver):
            return budget
    raise AssertionError(f"no budget above {least} forces {solver} to offload half the regions")
