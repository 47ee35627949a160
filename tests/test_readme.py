"""The README cannot drift: every command it shows runs here and prints the lines shown.

Each ```console block holds ``$ command`` lines, each followed by the output the README
shows for it. The test runs the command in a scratch folder (holding the README's
``profile.json``) and compares the output line by line: exactly, except for numbers that
depend on the machine (timings, and everything a training run measures), which only
have to be numbers. The README's Python snippets run too.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
NUMBER = r"[-+]?[0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?"


def _fenced(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```", README, re.S | re.M)


def _commands() -> list[tuple[str, list[str]]]:
    """(command, the output lines shown for it) for every ``$`` line of every console block."""
    found: list[tuple[str, list[str]]] = []
    for block in _fenced("console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append((line[2:], []))
            else:
                assert found, f"output before any command in a console block: {line!r}"
                found[-1][1].append(line)
    return found


def _argv(command: str) -> list[str]:
    """The command as this interpreter runs it (no reliance on PATH)."""
    words = shlex.split(command)
    if words[0] == "offload-solve":
        return [sys.executable, "-m", "offload_solver", *words[1:]]
    if words[:2] == ["python", "-m"]:
        return [sys.executable, *words[1:]]
    raise AssertionError(f"the README shows a command this test cannot run: {command!r}")


def _pattern(shown: str, command: str) -> re.Pattern[str]:
    """The shown line as a pattern: numbers the machine decides match any number."""
    parts = re.split(f"({NUMBER})", shown.rstrip())
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
            continue
        before = "".join(parts[:i])
        # A training run measures everything it prints; the solver is deterministic for a
        # given profile and hardware but for its own wall time.
        machine = "offload_gpt_example" in command or before.endswith("solved in ")
        out.append(NUMBER if machine else re.escape(part))
    return re.compile("".join(out) + r"\s*")


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    (profile,) = [b for b in _fenced("json") if '"operations"' in b]
    (tmp_path / "profile.json").write_text(profile, encoding="utf-8")
    return tmp_path


def test_the_readme_shows_commands() -> None:
    commands = [c for c, _ in _commands()]
    assert any(c.startswith("offload-solve ") for c in commands)
    assert any("offload_gpt_example" in c for c in commands)


@pytest.mark.parametrize("command, shown", _commands(), ids=lambda v: str(v)[:40])
def test_a_readme_command_prints_what_the_readme_shows(
    command: str, shown: list[str], scratch: Path
) -> None:
    done = subprocess.run(
        _argv(command), cwd=scratch, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert len(printed) == len(shown), f"printed:\n{done.stdout}\nshown:\n" + "\n".join(shown)
    for got, want in zip(printed, shown, strict=True):
        assert _pattern(want, command).fullmatch(got), f"printed {got!r}\nshown   {want!r}"


def test_the_readme_solver_snippet_runs(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (snippet,) = [b for b in _fenced("python") if "from offload_solver" in b]
    monkeypatch.chdir(scratch)
    exec(compile(snippet, "README.md", "exec"), {})
    assert (scratch / "plan.json").read_text(encoding="utf-8").startswith("{")


def test_the_readme_training_loop_trains() -> None:
    """The loop snippet, with a tiny GPT-2 and two random batches standing in for the
    reader's model and data loader."""
    import torch

    from offload_gpt_example.models import build_model, labels_for, lm_loss, random_batch

    (snippet,) = [b for b in _fenced("python") if "memory_optimize" in b]
    torch.manual_seed(0)
    batch = random_batch(2, 8, device="cpu")
    namespace = {
        "model": build_model("gpt2_tiny", device="cpu", dtype=torch.float32, seq_len=8),
        "example_inputs": batch,
        "loader": [batch, batch],
        "loss_fn": lambda out, b: lm_loss(out, labels_for(b)),
    }
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert torch.isfinite(namespace["loss"]).item()
    assert namespace["optimizer"].optimizer.state  # it stepped
