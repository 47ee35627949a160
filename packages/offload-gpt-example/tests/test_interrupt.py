"""Ctrl-C in training: the step in progress completes, the run prints its summary and
exits 130, and ``--save_on_interrupt`` writes a checkpoint that ``--resume`` continues
bit for bit as the uninterrupted run. Run in this process on gpt2_tiny in fp32 on the CPU,
the interrupt a real SIGINT sent from inside a training step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import offload_gpt_example.__main__ as example
from offload_gpt_example.interrupt import StopOnInterrupt, load_checkpoint
from offload_optim import AMPOptimizer

TINY = ["--model_type", "gpt2_tiny", "--device", "cpu", "--no_progress", "--dtype", "fp32"]
BASE = [*TINY, "--batch_size", "2", "--steps", "6", "--memory_budget", "0.004"]


def run(
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    interrupt_at: int | None = None,
) -> tuple[int, str, dict[str, torch.Tensor]]:
    """(exit code, stdout, the masters after the last step) of the example; with
    ``interrupt_at``, SIGINT arrives during that training step's backward (1-based)."""
    calls = [0]
    backward_of = AMPOptimizer.backward

    def backward(self: AMPOptimizer, loss: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        backward_of(self, loss)

    masters: dict[str, torch.Tensor] = {}
    report = example.report_run

    def report_run(args: Any, module: Any, *rest: Any) -> None:
        masters.update({k: v.clone() for k, v in module.state_dict().items()})
        report(args, module, *rest)

    monkeypatch.setattr(AMPOptimizer, "backward", backward)
    monkeypatch.setattr(example, "report_run", report_run)
    code = example.main(argv)
    out = capsys.readouterr().out
    return code, out, masters


def test_an_interrupted_run_resumed_trains_as_the_uninterrupted_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, straight = run([*BASE, "--log_dir", str(tmp_path / "a")], capsys, monkeypatch)
    assert code == 0, out
    final = example_final_loss(out)

    ckpt = tmp_path / "ckpt" / "run.pt"
    argv = [*BASE, "--log_dir", str(tmp_path / "b"), "--save_on_interrupt", str(ckpt)]
    # The handler the run found (a process started in the background ignores SIGINT).
    before = signal.getsignal(signal.SIGINT)
    code, out, _ = run(argv, capsys, monkeypatch, interrupt_at=3)
    assert code == example.EXIT_INTERRUPTED
    # The third step completed (the interrupt arrived inside it); the summary printed.
    assert "interrupted after 3 of 6 steps" in out and "exec_time=" in out
    assert f"checkpoint saved to {ckpt}" in out and ckpt.is_file()
    assert [p.name for p in ckpt.parent.iterdir()] == ["run.pt"]  # written whole
    assert signal.getsignal(signal.SIGINT) is before  # restored

    argv = [*BASE, "--log_dir", str(tmp_path / "c"), "--resume", str(ckpt)]
    code, out, resumed = run(argv, capsys, monkeypatch)
    assert code == 0, out
    assert "resumed from" in out and "after 3 of 6 steps" in out
    assert example_final_loss(out) == final
    assert straight.keys() == resumed.keys()
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name


def example_final_loss(out: str) -> str:
    line = next(ln for ln in out.splitlines() if ln.startswith("final_loss="))
    return line.split("=", 1)[1]


def test_a_second_interrupt_aborts_at_once() -> None:
    with StopOnInterrupt() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_resume_names_a_missing_or_foreign_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        example.main([*BASE, "--resume", str(tmp_path / "none.pt")])
    assert "no such checkpoint file (or directory)" in capsys.readouterr().err
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(ValueError, match="not a checkpoint of this example"):
        load_checkpoint(foreign, None)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        example.main([*TINY, "--plan_only", "--resume", str(foreign)])
    assert "do not go with --plan_only" in capsys.readouterr().err


DRIVER = """
import os, signal, sys
import torch
import offload_gpt_example.__main__ as example
from offload_optim import AMPOptimizer

rank, at = int(os.environ["RANK"]), int(os.environ["INTERRUPT_AT"])
target = int(os.environ.get("INTERRUPT_RANK", "1"))
calls = [0]
backward_of, report = AMPOptimizer.backward, example.report_run

def backward(self, loss):
    calls[0] += 1
    if rank == target and calls[0] == at:
        os.kill(os.getpid(), signal.SIGINT)
    backward_of(self, loss)

def report_run(args, module, *rest):
    torch.save(module.state_dict(), os.environ["MASTERS"] + f".{rank}")
    report(args, module, *rest)

AMPOptimizer.backward, example.report_run = backward, report_run
sys.exit(example.main(sys.argv[1:]))
"""


def test_a_data_parallel_run_interrupted_on_one_rank_stops_every_rank_and_resumes(
    tmp_path: Path,
) -> None:
    """Under torchrun (2 ranks, gloo), a Ctrl-C that reaches rank 1 alone in step 3 stops
    both ranks after that step; each saves its share of a distributed checkpoint, and the
    run resumed from it on 2 ranks ends bit for bit where the uninterrupted run ends (no
    dropout: the checkpoint holds no random state), and resumes on one process too; a
    one-process checkpoint resumes on 2 ranks."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    argv = [*BASE, "--dropout", "0", "--log_dir", str(tmp_path / "logs")]
    ckpt = tmp_path / "ckpt"

    def launch(name: str, *extra: str, at: int = 0, ranks: int = 2) -> str:
        env = {**os.environ, "INTERRUPT_AT": str(at), "MASTERS": str(tmp_path / name)}
        if ranks == 1:  # one process, no torchrun
            env["RANK"] = env["INTERRUPT_RANK"] = "0"
            command = [sys.executable, str(driver), *argv, *extra]
        else:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                str(driver),
                *argv,
                *extra,
            ]
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        want = example.EXIT_INTERRUPTED if at else 0
        if ranks == 1:
            assert proc.returncode == want, proc.stdout + proc.stderr
        else:  # torchrun fails when a rank exits with a non-zero code
            assert (proc.returncode == 0) == (want == 0), proc.stdout + proc.stderr
        return proc.stdout

    launch("straight")
    out = launch("stopped", "--save_on_interrupt", str(ckpt), at=3)
    assert out.count("interrupted after 3 of 6 steps") == 2, out
    assert ckpt.is_dir()
    out = launch("resumed", "--resume", str(ckpt))
    assert out.count("resumed from") == 2 and "after 3 of 6 steps" in out, out
    for rank in range(2):
        straight = torch.load(tmp_path / f"straight.{rank}", weights_only=True)
        resumed = torch.load(tmp_path / f"resumed.{rank}", weights_only=True)
        for name, value in straight.items():
            assert torch.equal(value, resumed[name]), (rank, name)
    out = launch("alone", "--resume", str(ckpt), ranks=1)
    assert "resumed from" in out and "after 3 of 6 steps" in out, out
    # And a one-process checkpoint (a file) resumes on 2 ranks, each taking its share.
    single = tmp_path / "single.pt"
    launch("one", "--save_on_interrupt", str(single), at=3, ranks=1)
    out = launch("shared", "--resume", str(single))
    assert out.count("resumed from") == 2 and "after 3 of 6 steps" in out, out
