"""llama_tiny trained through ``memory_optimize`` in fp32 against plain PyTorch: the
same gradients, and the same parameters after AdamW steps (the GPT-2 equivalence tests'
tolerances), with rotary embeddings, grouped-query SDPA, RMSNorm and the SiLU-gated MLP
offloaded region by region."""

from __future__ import annotations

import copy

import torch

from offload_gpt_example.models import build_model, get_spec, lm_loss, random_batch
from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig, default_cpu_profile, memory_optimize
from offload_solver import InfeasibleBudgetError

STEPS = 12
BATCH, SEQ = 2, 16
GRAD_TOL = 1e-6  # the first step's: as test_equivalence's fp32 gradients
LOSS_TOL = 1e-5  # as test_memory_optimize's AdamW curves
PARAM_TOL = 1e-5  # the last step's gradients and the trained parameters: rounding
# differences of the two optimizers' fp32 steps accumulate over the steps


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def batches() -> list[dict[str, torch.Tensor]]:
    """Counting sequences (mod 32) from random starts: easy to learn, so a test can tell
    training from a broken run."""
    vocab = 32
    assert vocab <= get_spec("llama_tiny").vocab_size
    out = []
    for i in range(STEPS):
        gen = torch.Generator().manual_seed(100 + i)
        start = random_batch(BATCH, 1, generator=gen, vocab_size=vocab)
        out.append({"input_ids": (start["input_ids"] + torch.arange(SEQ)) % vocab})
    return out


def test_llama_tiny_through_memory_optimize_trains_like_adamw() -> None:
    model = build_model("llama_tiny", dtype=torch.float32, seq_len=SEQ, seed=0)
    reference = copy.deepcopy(model)
    data = batches()
    options = {
        "config": OffloadConfig(dtype=torch.float32),
        "hardware": default_cpu_profile(),
        "device": "cpu",
        "progress": False,
    }
    try:
        memory_optimize(model, data[0], 1, "asyn", **options)  # type: ignore[arg-type]
        raise AssertionError("a 1-byte budget was accepted")
    except InfeasibleBudgetError as exc:
        least = exc.least_budget_bytes
    # At the least budget the planner offloads all it can.
    module = memory_optimize(model, data[0], least, "asyn", **options)  # type: ignore[arg-type]
    assert any(st.offloaded for st in module.storages)
    assert len(module.plan.regions) > 1
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    losses, expected = [], []
    for step, batch in enumerate(data):
        amp.zero_grad()
        loss = lm_loss(module(**batch), batch["input_ids"])
        amp.backward(loss)
        opt.zero_grad()
        ref_loss = lm_loss(reference(**batch), batch["input_ids"])
        ref_loss.backward()  # type: ignore[no-untyped-call]
        if step in (0, STEPS - 1):
            tol = GRAD_TOL if step == 0 else PARAM_TOL
            grads = dict(module.named_gradients())
            for name, p in reference.named_parameters():
                assert p.grad is not None
                assert rel_err(grads[name], p.grad) <= tol, (step, name)
        amp.step()
        opt.step()
        losses.append(loss.item())
        expected.append(ref_loss.item())
    amp.synchronize()
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, expected, strict=True)) < LOSS_TOL
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, f"it trains: {losses}"
    trained = dict(module.named_parameters())
    for name, p in reference.named_parameters():
        assert rel_err(trained[name].detach(), p.detach()) <= PARAM_TOL, name
    module.close()
