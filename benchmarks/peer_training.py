"""Does the full-GPU peer's training train? Its recipes, a few steps each (CPU, no GPU).

    python benchmarks/peer_training.py                  # gpt2_tiny at W3's 8 x 1024, 8 steps
    python benchmarks/peer_training.py --steps 12 --batch 4 --seq 256

Runs ``offload_bench._full_gpu_steps`` on the CPU with the zoo's ``gpt2_tiny`` for each
recipe: fp16 weights and fp16 Adam state with the loss unscaled (every full-GPU row before
session 39), the same with ``torch.amp.GradScaler`` (session 39's default), and torch's
mixed-precision recipe (``full_gpu_amp``: an fp32 model under fp16 autocast, fp32 Adam
state, loss scaled), and fp16 weights with fp32 masters and state (``full_gpu_master``).
Before each step it prints the loss, the largest weight, the share of
Adam's second moments that are zero (fp16 cannot hold ``(1 - 0.999) * g**2`` for the
gradients of a model this size: below 2**-24 it rounds to zero, and Adam then divides
the first moment by ``eps`` alone), the loss scale, and at the end how many steps the
scaler skipped (an inf or nan gradient).

Session 39 ran the first command (2-5 minutes): with fp16 state, 96-100% of the second
moments were zero after the first step. Unscaled, the largest weight went from 1 to 11.6
in five steps and the loss from 6.93 to 7.48; scaled, to 6.48 in three and the loss to
7.70, after which the scaler skipped 4 of the 8 steps, halving its scale each time. By
torch's mixed-precision recipe no second moment was zero and the loss fell every step
(6.96 to 6.83). So the fp16-state peer's steps after the first few run on diverged
weights and overflowing gradients: it times its kernels on that data, not training.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RECIPES = {
    "fp16_unscaled": ("fp16", False),
    "fp16_scaled": ("fp16", True),
    "amp": ("amp", True),
    "master": ("master", True),
}
"""Each recipe run here: ``offload_bench._full_gpu_steps``'s recipe, and whether the loss
is scaled (the fp16 recipe either way; the others always)."""


@dataclass(frozen=True)
class Before:
    """The state before one step."""

    loss: float
    largest_weight: float
    zero_second_moments: float | None
    """Share of the first parameter's ``exp_avg_sq`` that is zero (None before a step)."""
    loss_scale: float | None


def run(recipe: str, steps: int, batch: int, seq: int) -> tuple[list[Before], int]:
    """``steps`` steps of ``recipe`` on gpt2_tiny: the state before each, and how many
    steps the scaler skipped (0 unscaled)."""
    import offload_bench
    import torch

    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}; known: {', '.join(RECIPES)}")
    offload_bench.WORKLOADS["_peer_training"] = ("gpt2_tiny", batch, seq, 1)
    try:
        torch.manual_seed(0)
        bench_recipe, scaled = RECIPES[recipe]
        full = offload_bench._full_gpu_steps(
            "_peer_training", bench_recipe, device="cpu", scaled=scaled
        )
    finally:
        del offload_bench.WORKLOADS["_peer_training"]
    params = full.parameters()
    stepped = full.optimizer.param_groups[0]["params"][0]  # "master": its fp32 copy
    out = []
    skipped = 0
    for _ in range(steps):
        state = full.optimizer.state.get(stepped, {})
        v = state.get("exp_avg_sq")
        scale = full.loss_scale()
        out.append(
            Before(
                loss=full.loss(),
                largest_weight=max(float(p.detach().abs().max()) for p in params),
                zero_second_moments=None if v is None else float((v == 0).float().mean()),
                loss_scale=scale,
            )
        )
        full.step()
        after = full.loss_scale()
        if scale is not None and after is not None and after < scale:
            skipped += 1  # the scaler halves its scale on the steps it skips
    return out, skipped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        parser.error("--steps and --batch must be >= 1, --seq >= 2")
    for recipe in args.recipes.split(","):
        befores, skipped = run(recipe, args.steps, args.batch, args.seq)
        for i, b in enumerate(befores):
            zero = "-" if b.zero_second_moments is None else f"{100 * b.zero_second_moments:.1f}%"
            scale = "-" if b.loss_scale is None else f"{b.loss_scale:g}"
            print(
                f"{recipe} step {i}: loss {b.loss:.3f}, largest weight {b.largest_weight:.3g}, "
                f"zero second moments {zero}, loss scale {scale}"
            )
        print(f"{recipe}: {skipped} of {args.steps} steps skipped by the scaler")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
