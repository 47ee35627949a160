"""Loss curves of HybridAdam with fp32 against bf16 host Adam moments (CPU or GPU).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/moments_curve.py \
        --model gpt2_medium --steps 200 --batch 4 --seq 32 --json curves.json

Both runs start from the same weights and see the same batches; every region keeps its
master weights and Adam state on the host (``state_on_device=False``), so
``moments_dtype=torch.bfloat16`` applies to every parameter. Training is fp32 on the CPU
(or fp16 with loss scaling on CUDA). The batches come from a fixed random Markov chain
over the vocabulary (each token has a few likely successors), so the loss has somewhere to
fall to: its entropy rate, printed at the start, is the floor a perfect model reaches.
Prints both curves every ``--every`` steps, then the largest per-step relative difference
and the difference of the mean loss over the last 20 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def markov_chain(vocab: int, successors: int, seed: int) -> tuple[torch.Tensor, float]:
    """A transition matrix where each token has ``successors`` likely next tokens (90% of
    the mass, the rest spread over the vocabulary), and its entropy rate in nats."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 0.1 / vocab)
    for tok in range(vocab):
        nxt = torch.randperm(vocab, generator=gen)[:successors]
        probs[tok, nxt] += 0.9 / successors
    probs /= probs.sum(dim=1, keepdim=True)
    entropy = float(-(probs * probs.log()).sum(dim=1).mean())
    return probs, entropy


def sample(probs: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    import torch

    assert isinstance(probs, torch.Tensor) and isinstance(gen, torch.Generator)
    vocab = probs.shape[0]
    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    for t in range(1, seq):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=gen).squeeze(1)
    return ids


def run(args: argparse.Namespace, moments: torch.dtype) -> list[float]:
    import torch

    from offload_gpt_example.models import build_model, lm_loss
    from offload_optim import AMPOptimizer, HybridAdam
    from offload_runtime import memory_optimize

    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    dtype = torch.float16 if cuda else torch.float32
    torch.manual_seed(args.seed)
    model = build_model(args.model, device="cpu", dtype=dtype, seq_len=args.seq, dropout=0.0)
    probs, _ = markov_chain(args.vocab, args.successors, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    example = {"input_ids": sample(probs, args.batch, args.seq, gen).to(device)}
    module = memory_optimize(
        model,
        example,
        64 * 2**30,
        "asyn",
        dtype=dtype,
        device=device,
        progress=False,
        state_on_device=False,
    )
    del model
    opt = AMPOptimizer(
        HybridAdam(module.parameters(), lr=args.lr, weight_decay=0.01, moments_dtype=moments),
        module,
    )
    gen = torch.Generator().manual_seed(args.seed + 2)  # the same batches for both runs
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        ids = sample(probs, args.batch, args.seq, gen).to(device)
        opt.zero_grad()
        loss = lm_loss(module(input_ids=ids), ids)
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
        if step % args.every == 0 or step == args.steps - 1:
            rate = (step + 1) / (time.perf_counter() - start)
            print(f"{moments} step {step}: loss {losses[-1]:.4f} ({rate:.2f} steps/s)", flush=True)
    module.close()
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2_medium")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--vocab", type=int, default=1024, help="the zoo's vocabulary size")
    parser.add_argument("--successors", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with CUDA")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    import torch

    _, entropy = markov_chain(args.vocab, args.successors, args.seed)
    print(
        f"data: Markov chain, entropy rate {entropy:.3f} nats (ln vocab {math.log(args.vocab):.3f})"
    )
    curves = {str(m): run(args, m) for m in (torch.float32, torch.bfloat16)}
    fp32, bf16 = curves["torch.float32"], curves["torch.bfloat16"]
    worst = max(abs(a - b) / b for a, b in zip(bf16, fp32, strict=True))
    tail = min(20, len(fp32))
    tail32, tail16 = sum(fp32[-tail:]) / tail, sum(bf16[-tail:]) / tail
    print(
        f"largest per-step relative difference {worst:.4f}; mean loss of the last {tail} steps: "
        f"fp32 moments {tail32:.4f}, bf16 moments {tail16:.4f} "
        f"({(tail16 - tail32) / tail32:+.2%}); first loss {fp32[0]:.4f}"
    )
    if args.json:
        doc = {"args": vars(args), "entropy": entropy, "curves": curves}
        Path(args.json).write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
