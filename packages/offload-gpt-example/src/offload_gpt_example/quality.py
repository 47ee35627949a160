"""What each rung of the host-state precision ladder costs in quality, measured.

A small GPT-2 trains on a fixed synthetic corpus with every rung of
``OffloadConfig.host_state`` (all of its optimizer state on the host, planned by the
planner), and once with plain ``torch.optim.AdamW`` on an fp32 copy of the model; each
run's loss curve and final held-out loss are compared.

The corpus is a fixed Markov chain over the vocabulary: every token has four successors,
drawn with probabilities 0.55, 0.25, 0.15 and 0.05, so the best achievable loss is the
chain's entropy (about 1.15 nats), well above zero, and a loss gap between rungs is a gap
in what the optimizer learned, not noise around zero. Every rung trains in bf16 (the
bf16-master rungs need it), so the rungs differ only in their host state's precision;
``fp32`` there is the mixed-precision reference (fp32 master and moments).

Run ``python -m offload_gpt_example.quality --steps 300 --out DIR`` for the curves (a
PNG and a JSON summary); offload-gpt-example's tests train the same runs and assert each
rung's tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from offload_gpt_example.models import LMModel, build_model, get_spec, lm_loss
from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig, PlanForce
from offload_runtime.planning import build_offload_module, plan_model
from offload_solver import HOST_STATES, write_atomic

MODEL = "gpt2_micro"
"""The model: the zoo's 2 blocks of width 64 over its 1024-token vocabulary."""
SEQ_LEN = 32
BATCH = 16
LR = 3e-3
WEIGHT_DECAY = 0.01
EVAL_BATCHES = 8
SUCCESSOR_P = (0.55, 0.25, 0.15, 0.05)
"""Probabilities of each token's four successors in the corpus."""
TOLERANCE = {
    "fp32": 0.02,
    "bf16_moments": 0.01,
    "bf16_stochastic": 0.01,
    "bf16_8bit": 0.02,
}
"""Largest relative excess of a rung's final held-out loss over fp32 AdamW's (the issue's
targets: 1% for bf16 moments and stochastic rounding, 2% for 8-bit moments; the fp32 rung
differs from plain fp32 training by its bf16 compute only). ``bf16_nearest`` (torchao's
numerics) has none: its gap is what it is, and the report shows it."""
REFERENCE = "adamw_fp32"
"""The name of the plain-PyTorch run (fp32 model, ``torch.optim.AdamW``)."""


@dataclass(frozen=True)
class Run:
    """One training run's loss per step and final held-out loss."""

    name: str
    losses: list[float]
    eval_loss: float


def _corpus(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(successors, their probabilities): each token's four next tokens."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:4] for _ in range(vocab)])
    return successors, torch.tensor(SUCCESSOR_P)


def batch(step: int, successors: torch.Tensor, probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch of training step ``step`` (evaluation batches use negative steps)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    vocab = successors.shape[0]
    ids = torch.empty(BATCH, SEQ_LEN, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (BATCH,), generator=gen)
    for t in range(1, SEQ_LEN):
        pick = torch.multinomial(probs.expand(BATCH, -1), 1, generator=gen).squeeze(1)
        ids[:, t] = successors[ids[:, t - 1], pick]
    return {"input_ids": ids}


def entropy_nats() -> float:
    """The corpus's entropy per token: the least loss any model reaches."""
    return -sum(p * math.log(p) for p in SUCCESSOR_P)


def _model(dtype: torch.dtype) -> LMModel:
    return build_model(MODEL, dtype=dtype, seq_len=SEQ_LEN, dropout=0.0, seed=0)


def train(name: str, steps: int, *, progress: Callable[[str, int], None] | None = None) -> Run:
    """Train run ``name`` (a rung of :data:`HOST_STATES`, or :data:`REFERENCE`) for
    ``steps`` steps; its per-step losses and mean held-out loss over
    :data:`EVAL_BATCHES` batches after training."""
    successors, probs = _corpus(get_spec(MODEL).vocab_size)
    first = batch(0, successors, probs)
    losses: list[float] = []
    if name == REFERENCE:
        model = _model(torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        for step in range(steps):
            b = batch(step, successors, probs)
            opt.zero_grad()
            loss = lm_loss(model(**b), b["input_ids"])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            losses.append(loss.item())
            if progress is not None:
                progress(name, step)
        forward: Callable[..., torch.Tensor] = model
    else:
        if name not in HOST_STATES:
            raise ValueError(f"unknown run {name!r}: use one of {HOST_STATES} or {REFERENCE!r}")
        config = OffloadConfig(dtype=torch.bfloat16, host_state=name)
        model = _model(torch.bfloat16)
        planned = plan_model(
            model,
            first,
            2**34,
            config=config,
            force=PlanForce(state_on_device=False),
            progress=False,
        )
        module = build_offload_module(model, planned)
        amp = AMPOptimizer(
            HybridAdam(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY), module
        )
        for step in range(steps):
            b = batch(step, successors, probs)
            amp.zero_grad()
            loss = lm_loss(module(**b), b["input_ids"])
            amp.backward(loss)
            amp.step()
            losses.append(loss.item())
            if progress is not None:
                progress(name, step)
        amp.synchronize()
        module.eval()
        forward = module
    with torch.no_grad():
        held_out = [batch(-1 - k, successors, probs) for k in range(EVAL_BATCHES)]
        total = sum(lm_loss(forward(**b), b["input_ids"]).item() for b in held_out)
    return Run(name, losses, total / EVAL_BATCHES)


def train_all(
    steps: int,
    names: Sequence[str] = (REFERENCE, *HOST_STATES),
    *,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Run]:
    """:func:`train` for each of ``names``."""
    return {name: train(name, steps, progress=progress) for name in names}


def excess(runs: dict[str, Run], name: str) -> float:
    """Run ``name``'s final held-out loss over the fp32 AdamW run's, minus 1."""
    return runs[name].eval_loss / runs[REFERENCE].eval_loss - 1.0


def summary(runs: dict[str, Run]) -> dict[str, object]:
    """The report's numbers: each run's final held-out loss, its excess over fp32 AdamW,
    and its tolerance."""
    return {
        "steps": len(runs[REFERENCE].losses),
        "entropy_nats": entropy_nats(),
        "runs": {
            name: {
                "eval_loss": run.eval_loss,
                "excess": excess(runs, name),
                "tolerance": TOLERANCE.get(name),
                "last_train_loss": run.losses[-1],
            }
            for name, run in runs.items()
        },
    }


def plot(runs: dict[str, Run], path: Path) -> None:
    """Each run's training loss per step (a running mean over 10 steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for name, run in runs.items():
        xs = range(len(run.losses))
        smooth = [sum(run.losses[max(0, i - 9) : i + 1]) / (i + 1 - max(0, i - 9)) for i in xs]
        ax.plot(xs, smooth, label=f"{name} (held-out {run.eval_loss:.4f})", linewidth=1.2)
    ax.axhline(entropy_nats(), color="grey", linestyle=":", label="corpus entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats, 10-step mean)")
    ax.set_ylim(bottom=0.9 * entropy_nats(), top=4.0)
    ax.set_title("Host-state precision ladder: a small GPT-2 on a Markov corpus")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG and JSON")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)

    def say(name: str, step: int) -> None:
        if (step + 1) % 100 == 0:
            print(f"{name}: step {step + 1}/{args.steps}", flush=True)

    runs = train_all(args.steps, progress=say)
    plot(runs, args.out / "host_state_quality.png")
    write_atomic(args.out / "host_state_quality.json", json.dumps(summary(runs), indent=1))
    for name, run in runs.items():
        print(f"{name:16s} held-out {run.eval_loss:.4f}  excess {excess(runs, name):+.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
