"""A checkpoint saved at step 10 and resumed in a fresh process continues the run exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_run import build_run
from optim_helpers import batch, loss_of, offload_module, tiny_gpt2, train_offload

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig

HERE = Path(__file__).parent


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: about 15 s
def test_resume_in_a_fresh_process_gives_identical_losses(tmp_path: Path) -> None:
    amp, module, sched = build_run(seed=0)
    losses = []
    for step in range(20):
        losses += train_offload(amp, module, range(step, step + 1))
        sched.step()
        if step == 9:
            path = tmp_path / "ckpt.pt"
            torch.save({"amp": amp.state_dict(), "scheduler": sched.state_dict()}, path)
            saved_scale, saved_steps = amp.loss_scale, amp.step_count
    # The run must exercise the scaler: it started too high and backed off at least once.
    assert saved_scale < 2.0**20 and saved_steps < 10
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, str(HERE / "resume_child.py"), str(path), "10", "20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = json.loads(out.stdout.strip().splitlines()[-1])
    assert resumed["losses"] == losses[10:], "resumed losses must be bit-identical"
    assert resumed["scale"] == amp.loss_scale
    assert resumed["steps"] == amp.step_count


def test_state_dict_holds_masters_moments_scaler_and_steps() -> None:
    amp, module, _ = build_run(seed=0)
    train_offload(amp, module, range(3))
    state = amp.state_dict()
    names = {name for name, _ in module.named_parameters()}
    assert names <= set(state["module"])
    some = next(iter(state["optimizer"]["state"].values()))
    assert set(some) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["scaler"]["scale"] == amp.loss_scale
    assert state["step_count"] == amp.step_count
    assert set(amp.state_dict(masters=False)) == set(state) - {"module"}


def test_loading_into_a_mismatched_optimizer_names_the_problem() -> None:
    amp, _, _ = build_run(seed=0)
    state = amp.state_dict()
    other = offload_module(tiny_gpt2(), batch(0))
    params = list(other.parameters())
    smaller = AMPOptimizer(HybridAdam(params[:-1]), other)
    with pytest.raises(ValueError, match="parameter groups of sizes"):
        smaller.load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        smaller.load_state_dict({"module": state["module"]})


def test_state_dict_refused_mid_accumulation() -> None:
    config = OffloadConfig(dtype=torch.float32, accumulation_steps=2)
    module = offload_module(tiny_gpt2(), batch(0), config=config)
    amp = AMPOptimizer(HybridAdam(module.parameters()), module)
    b = batch(0)
    amp.backward(loss_of(module(**b), b["input_ids"]))
    with pytest.raises(RuntimeError, match="accumulation window"):
        amp.state_dict()
