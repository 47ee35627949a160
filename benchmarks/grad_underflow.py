"""How much of fp16 training's gradients underflow without a loss scale (CPU, no GPU).

    python benchmarks/grad_underflow.py          # GPT-2 XL width, 4 layers, W3 batch
    python benchmarks/grad_underflow.py --layers 2 --batch 2 --seq 256

Builds a GPT-2 of ``--layers`` blocks at GPT-2 XL's width (1600, 25 heads; vocabulary 1024,
as the benchmark's workloads), in fp16, runs forward and backward once per ``--scales``
entry (the loss multiplied by it, as a loss scaler does), and prints for each the share of
the gradients that came out zero and subnormal (nonzero, below fp16's smallest normal,
2**-14): of the parameters' gradients, and of each block's MLP input projection's and
attention input projection's output gradients (what the backward's GEMMs read).

Session 39 ran the first command (3-5 minutes): unscaled, every element of the blocks'
output gradients came out zero or subnormal (the MLP's 87-92% subnormal, 8-13% zero;
attention's 40-95% subnormal, 5-60% zero), and 45% of the parameters' gradients
subnormal; at 2**16, 0.1% zero and at most 3.3% subnormal. That is why
``offload_bench.py``'s full-GPU training scales its loss from then on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

FP16_SMALLEST_NORMAL = 2.0**-14
"""Below this (and not zero), an fp16 value is subnormal: it keeps fewer significant bits."""


@dataclass(frozen=True)
class Shares:
    """Of some gradients: the fraction that is zero, and that is subnormal."""

    zero: float
    subnormal: float


def shares(tensors: list[Any]) -> Shares:
    """Zero and subnormal fractions over every element of ``tensors`` (fp16 or wider)."""
    total = zero = sub = 0
    for t in tensors:
        a = t.detach().abs()
        total += a.numel()
        zero += int((a == 0).sum())
        sub += int(((a > 0) & (a < FP16_SMALLEST_NORMAL)).sum())
    if total == 0:
        raise ValueError("no gradient elements to count")
    return Shares(zero / total, sub / total)


def measure(
    layers: int, batch: int, seq: int, scales: list[float], width: int = 1600, heads: int = 25
) -> list[tuple[float, Shares, dict[str, Shares]]]:
    """For each scale: the parameters' gradient shares, and each hooked output's."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from offload_gpt_example.models import lm_loss, random_batch

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_embd=width,
        n_head=heads,
        n_layer=layers,
        vocab_size=1024,
        n_positions=max(seq, 8),
        activation_function="gelu_pytorch_tanh",
        bos_token_id=0,
        eos_token_id=0,
    )
    model: Any = GPT2LMHeadModel(cfg)
    model = model.half()
    data = random_batch(batch, seq, device="cpu")
    seen: dict[str, Any] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(module: Any, grad_in: Any, grad_out: Any) -> None:
            seen[name] = grad_out[0].detach().clone()

        return hook

    handles = []
    for i, block in enumerate(model.transformer.h):
        handles.append(block.mlp.c_fc.register_full_backward_hook(keep(f"h{i}.mlp.c_fc")))
        handles.append(block.attn.c_attn.register_full_backward_hook(keep(f"h{i}.attn.c_attn")))
    out = []
    try:
        for scale in scales:
            model.zero_grad(set_to_none=True)
            seen.clear()
            loss = lm_loss(model(**data).logits, data["input_ids"])
            torch.autograd.backward(loss * scale)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            out.append((scale, shares(grads), {k: shares([v]) for k, v in sorted(seen.items())}))
    finally:
        for h in handles:
            h.remove()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--heads", type=int, default=25)
    parser.add_argument("--scales", default="1,65536", help="loss scales, comma-separated")
    args = parser.parse_args(argv)
    scales = [float(s) for s in args.scales.split(",")]
    if args.layers < 1 or args.batch < 1 or args.seq < 2 or any(s <= 0 for s in scales):
        parser.error("--layers and --batch must be >= 1, --seq >= 2, every scale > 0")
    for scale, params, outputs in measure(
        args.layers, args.batch, args.seq, scales, args.width, args.heads
    ):
        print(
            f"loss scale {scale:g}: parameter gradients {100 * params.zero:.1f}% zero, "
            f"{100 * params.subnormal:.1f}% subnormal"
        )
        for name, s in outputs.items():
            print(
                f"  {name} output gradient: {100 * s.zero:.1f}% zero, "
                f"{100 * s.subnormal:.1f}% subnormal"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
