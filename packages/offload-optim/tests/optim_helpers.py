"""Shared helpers of the offload-optim tests: a tiny GPT-2 and hand-made offload plans.

The plans mix every kind of region the runtime has, so that one model exercises them all:
parameters resident or offloaded (sync or async prefetch), and master weights plus Adam
state on the host or on the "device" (on a CPU-only machine both are host memory, but they
take different code paths: host-state regions go through the gradient staging buffer and
the host worker, device-state regions are stepped on the main thread).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from offload_runtime import OffloadConfig, PlanForce
from offload_runtime.module import OffloadModule
from offload_runtime.planning import build_offload_module, plan_model
from offload_solver import (
    HardwareProfile,
    InfeasibleBudgetError,
    ParamPlacement,
    Plan,
    PlanOptions,
    Region,
    RegionPlan,
    StatePlacement,
)
from offload_trace import rewrite_causal_attention

VOCAB = 96
SEQ = 8


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


def tiny_gpt2(
    layers: int = 3, width: int = 32, seed: int = 0, *, dropout: float = 0.0
) -> torch.nn.Module:
    """A GPT-2 small enough for fast CPU tests, every dropout at ``dropout`` (off by
    default: deterministic)."""
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_embd=width,
        n_layer=layers,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LogitsOnly(GPT2LMHeadModel(cfg))


def tiny_llama(layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama (hidden 32, 4 heads over 2 key-value heads, untied head, no cache).
    It has no biases: GPT-2's attention key bias has an exactly zero gradient, whose
    rounding noise Adam turns into full-size steps, so such weights cannot be compared
    with plain PyTorch's to 1e-5."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def batch(step: int, size: int = 4) -> dict[str, torch.Tensor]:
    """The (deterministic) batch of a training step: counting sequences, easy to learn.

    Each row counts up by one from a random start (mod the vocabulary), so the loss falls
    quickly and a test can tell a training run from a broken one.
    """
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    ids = (start + torch.arange(SEQ)) % VOCAB
    return {"input_ids": ids, "attention_mask": torch.ones(size, SEQ, dtype=torch.long)}


def loss_of(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Shifted next-token cross-entropy, computed in fp32."""
    shift = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(shift, input_ids[:, 1:].reshape(-1))


def _regions(
    gm: torch.fx.GraphModule, canon: dict[str, str], numel: dict[str, int], min_numel: int
) -> tuple[tuple[str, ...], list[tuple[int, int, tuple[str, ...]]]]:
    """Operation names, and regions cut where an operation first uses a new parameter.

    Consecutive cuts are merged until a region holds at least ``min_numel`` elements, as
    the solver's region builder does, so that a model has a handful of regions.
    """
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    owned: set[str] = set()
    cuts: list[tuple[int, list[str]]] = []
    for i, node in enumerate(ops):
        new = []
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and isinstance(arg.target, str) and arg.target in canon:
                name = canon[arg.target]
                if name not in owned:
                    owned.add(name)
                    new.append(name)
        if not new:
            continue
        if cuts and sum(numel[p] for p in cuts[-1][1]) < min_numel:
            cuts[-1][1].extend(new)
        else:
            cuts.append((i if cuts else 0, new))
    regions = []
    for k, (start, names) in enumerate(cuts):
        end = cuts[k + 1][0] if k + 1 < len(cuts) else len(ops)
        regions.append((start, end, tuple(names)))
    return tuple(n.name for n in ops), regions


def _placement(k: int, last: int, pinned: bool) -> tuple[ParamPlacement, StatePlacement]:
    """Cycle through every region kind; the first and last regions stay resident."""
    if pinned or k in (0, last):
        return ParamPlacement.RESIDENT, StatePlacement.HOST if k == 0 else StatePlacement.DEVICE
    kinds = [
        (ParamPlacement.SYNC, StatePlacement.HOST),
        (ParamPlacement.RESIDENT, StatePlacement.DEVICE),
        (ParamPlacement.ASYNC, StatePlacement.HOST),
        (ParamPlacement.RESIDENT, StatePlacement.HOST),
        (ParamPlacement.SYNC, StatePlacement.DEVICE),
    ]
    return kinds[(k - 1) % len(kinds)]


def offload_module(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    min_region_numel: int = 2000,
    all_host_state: bool = False,
    all_resident: bool = False,
    host_worker: bool | None = None,
    convert_on_device: bool = False,
    options: PlanOptions | None = None,
    config: OffloadConfig | None = None,
) -> OffloadModule:
    """An OffloadModule over a copy of ``model`` with a hand-made mixed plan.

    ``model`` itself is left untouched, so it can be trained in parallel as the reference.
    ``all_host_state`` / ``all_resident`` override the mix: every region keeps its optimizer
    state on the host / its parameters on the device. ``host_worker=True`` runs host work on
    the runtime's worker thread even on the CPU (the threaded path CUDA machines take).
    ``options``: the plan's options (default ``PlanOptions()``), with
    ``convert_on_device`` set; ``config``: the module's (default ``OffloadConfig(dtype=
    dtype)``; its dtype must be ``dtype``). A causal mask that export
    materialised is rewritten to ``is_causal=True`` as ``offload_trace.trace`` does, so
    that attention runs the fused kernels on CUDA.
    """
    device = torch.device(device)
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    named = dict(model.named_parameters(remove_duplicate=False))
    canon: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in named.items():
        first.setdefault(id(p), name)
        canon[name] = first[id(p)]
    ep = torch.export.export(model, (), inputs, strict=False)
    gm = ep.module()
    rewrite_causal_attention(gm, model)
    graph_eval = ep.module()
    rewrite_causal_attention(graph_eval, model)
    numel = {name: p.numel() for name, p in named.items()}
    op_names, regions = _regions(gm, canon, numel, min_region_numel)
    tied = tuple(
        tuple(n for n in named if canon[n] == c)
        for c in dict.fromkeys(canon.values())
        if sum(1 for n in named if canon[n] == c) > 1
    )
    tied_owners = {group[0] for group in tied}
    plans = []
    async_slot = 0
    for k, (start, end, names) in enumerate(regions):
        size = sum(numel[p] for p in names)
        pinned = any(p in tied_owners for p in names)
        placement, state = _placement(k, len(regions) - 1, pinned)
        if all_host_state:
            state = StatePlacement.HOST
        if all_resident:
            placement = ParamPlacement.RESIDENT
        region = Region(
            index=k,
            op_start=start,
            op_end=end,
            param_names=names,
            numel=size,
            size_bytes=size * 4,
            pinned=pinned,
        )
        if placement is ParamPlacement.SYNC:
            plans.append(RegionPlan(region, placement, state, pool_offset_bytes=0))
        elif placement is ParamPlacement.ASYNC:
            async_slot += 1
            plans.append(
                RegionPlan(
                    region,
                    placement,
                    state,
                    prefetch_at=min(k + 1, len(regions) - 1),
                    pool_offset_bytes=10**7 * (1 + async_slot % 2),
                )
            )
        else:
            plans.append(RegionPlan(region, placement, state))
    plan = Plan(
        solver="hand",
        budget_bytes=1,
        regions=tuple(plans),
        predicted_peak_bytes=0,
        predicted_step_time_s=0.0,
        timeline=(),
        memory_curve=(),
        pool_size_bytes=0,
        options=dataclasses.replace(
            PlanOptions() if options is None else options, convert_on_device=convert_on_device
        ),
    )
    targets = {n.target: n.target for n in gm.graph.nodes if n.op == "get_attr"}
    return OffloadModule(
        plan=plan,
        graph_train=gm,
        graph_eval=graph_eval,
        param_targets={t: t for t in targets if isinstance(t, str) and t in canon},
        canonical=canon,
        buffers={},
        state=named,
        device=device,
        dtype=dtype,
        op_names=op_names,
        tied_groups=tied,
        host_worker=host_worker,
        config=config,
    )


def region_kinds(module: OffloadModule) -> Iterator[tuple[bool, bool]]:
    """(offloaded, host_state) of every region, to check a plan covers every kind."""
    for st in module.storages:
        yield st.offloaded, st.host_state


def train_offload(
    amp: Any, module: OffloadModule, steps: range, *, micro: int = 1, size: int = 4
) -> list[float]:
    """Train ``steps`` through an AMPOptimizer; returns each step's loss (summed over micro)."""
    losses = []
    for step in steps:
        amp.zero_grad()
        total = 0.0
        for k in range(micro):
            b = batch(step * micro + k, size)
            loss = loss_of(module(**b), b["input_ids"]) / micro
            amp.backward(loss)
            total += loss.item()
        amp.step()
        losses.append(total)
    return losses


def train_plain(
    opt: torch.optim.Optimizer,
    model: torch.nn.Module,
    steps: range,
    *,
    size: int = 4,
    after_backward: Callable[[], object] | None = None,
    sched: Any = None,
) -> list[float]:
    """The reference: the same loop over the plain model with a torch optimizer."""
    losses = []
    for step in steps:
        opt.zero_grad()
        b = batch(step, size)
        loss = loss_of(model(**b), b["input_ids"])
        loss.backward()  # type: ignore[no-untyped-call]
        if after_backward is not None:
            after_backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def rel_diff(a: list[float], b: list[float]) -> float:
    """Largest relative difference between two loss curves."""
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def masters(module: OffloadModule) -> dict[str, torch.Tensor]:
    """Copies of the module's fp32 master weights."""
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def fell(losses: list[float], by: float = 0.1) -> bool:
    """Whether the mean of the last three losses is ``by`` below that of the first three."""
    return sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - by


def overflow_on_device(module: OffloadModule, when: Callable[[int], bool]) -> None:
    """Make a host-state region's gradients overflow *on the device* whenever ``when(r)``:
    an inf written into its first gradient before the copy to the host, the way a real
    fp16 overflow arrives, so that every overflow check sees it (fp16 without clipping
    takes it from the device gradients; the others from the host accumulator the inf is
    copied into). Register it before AMPOptimizer is built."""

    def hook(r: int, grads: list[torch.Tensor]) -> None:
        if when(r):
            with torch.no_grad():
                grads[0].view(-1)[0] = float("inf")

    module.controller.add_device_grad_hook(hook)


def plan_at_least_budget(
    model: torch.nn.Module,
    example: dict[str, torch.Tensor],
    solver: str = "asyn",
    scale: int = 1,
    *,
    dtype: torch.dtype | None = None,
    config: OffloadConfig | None = None,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = "cpu",
    margin_bytes: int = 0,
    **force: Any,
) -> OffloadModule:
    """The planner at ``scale`` times the least budget ``solver`` accepts for ``model``
    (asked for with a 1-byte budget) plus ``margin_bytes``, ``force``'s fields
    (``PlanForce``) fixed, and the module built; at scale 1 it offloads all it can.
    ``dtype``: ``OffloadConfig(dtype=)`` when no ``config`` is given. On a GPU the
    second plan reads the device bytes in use again, which a test's own allocations
    between the two may have moved by a kilobyte: a margin absorbs it."""
    forced = PlanForce(**force)
    if config is None and dtype is not None:
        config = OffloadConfig(dtype=dtype)

    def planned(budget: int) -> Any:
        return plan_model(
            model,
            example,
            budget,
            solver,
            config=config,
            hardware=hardware,
            device=device,
            progress=False,
            force=forced,
        )

    try:
        planned(1)
    except InfeasibleBudgetError as exc:
        least = exc.least_budget_bytes
    else:
        raise AssertionError("the planner accepted a 1-byte budget")
    return build_offload_module(model, planned(scale * least + margin_bytes))
