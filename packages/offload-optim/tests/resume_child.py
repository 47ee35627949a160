"""Child process of test_checkpoint.py: resume from a checkpoint and print the losses.

Usage: ``python resume_child.py CHECKPOINT FIRST_STEP LAST_STEP`` prints a JSON list of the
losses of steps FIRST_STEP..LAST_STEP-1, trained from the checkpoint in a fresh process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from checkpoint_run import build_run
from optim_helpers import train_offload


def main() -> None:
    path, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # A different seed: every value that matters must come from the checkpoint.
    amp, module, sched = build_run(seed=123)
    state = torch.load(path, weights_only=True)
    amp.load_state_dict(state["amp"])
    sched.load_state_dict(state["scheduler"])
    losses = []
    for step in range(first, last):
        losses += train_offload(amp, module, range(step, step + 1))
        sched.step()
    print(json.dumps({"losses": losses, "scale": amp.loss_scale, "steps": amp.step_count}))


if __name__ == "__main__":
    main()
