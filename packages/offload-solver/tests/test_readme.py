"""The package README's command-line example: its profile and its printed plan."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from offload_solver import ModelProfile, Operation, Parameter
from offload_solver.cli import main

PACKAGE = Path(__file__).resolve().parents[1]
REPO = PACKAGE.parents[1]
PROFILE = PACKAGE / "tests" / "data" / "gpt_like.profile.json"


def gpt_like_profile(
    layers: int = 8, hidden: int = 2048, vocab: int = 32000, tokens: int = 512, seq: int = 8
) -> ModelProfile:
    """A GPT-like model in fp16 (``tests/data/gpt_like.profile.json``): a token embedding
    tied to the output head, ``layers`` blocks of layer norm, attention (q/k/v and output
    projections) and a 4x MLP, at ``tokens`` tokens of ``seq``. Bytes and FLOPs are the
    shapes' (a forward matrix product 2 x tokens x its weights, backward twice that)."""
    elem = 2
    act = tokens * hidden * elem
    params: list[Parameter] = []
    ops: list[Operation] = []

    def param(name: str, numel: int) -> tuple[str]:
        params.append(Parameter(name, numel, numel * elem))
        return (name,)

    def op(
        name: str,
        uses: tuple[str, ...] = (),
        *,
        out: int = act,
        saved: int = 0,
        flop: int = 0,
        attention: bool = False,
    ) -> None:
        ops.append(
            Operation(
                name,
                uses,
                fwd_out_bytes=out,
                saved_bytes=saved,
                bwd_tmp_bytes=out,
                bwd_out_bytes=out,
                fwd_flop=flop,
                bwd_flop=2 * flop,
                attention=attention,
            )
        )

    h = hidden
    op("embed", param("wte", vocab * h), saved=tokens * 8)
    for i in range(layers):
        op(f"ln1_{i}", param(f"ln1_{i}", 2 * h), saved=act)
        qkv = 3 * h * h + 3 * h
        op(f"qkv_{i}", param(f"qkv_{i}", qkv), out=3 * act, saved=act, flop=6 * tokens * h * h)
        op(f"attn_{i}", saved=4 * act, flop=2 * tokens * seq * h, attention=True)
        op(f"proj_{i}", param(f"proj_{i}", h * h + h), saved=act, flop=2 * tokens * h * h)
        op(f"ln2_{i}", param(f"ln2_{i}", 2 * h), saved=act)
        fc = 4 * h * h + 4 * h
        op(f"fc_{i}", param(f"fc_{i}", fc), out=4 * act, saved=act, flop=8 * tokens * h * h)
        op(f"gelu_{i}", out=4 * act, saved=4 * act)
        fc2 = 4 * h * h + h
        op(f"fc2_{i}", param(f"fc2_{i}", fc2), saved=4 * act, flop=8 * tokens * h * h)
    op("ln_f", param("ln_f", 2 * h), saved=act)
    head_flop = 2 * tokens * h * vocab
    op("head", param("head", vocab * h), out=tokens * vocab * elem, saved=act, flop=head_flop)
    return ModelProfile("gpt-like", tuple(params), tuple(ops), tied_groups=(("wte", "head"),))


def readme_runs() -> list[tuple[list[str], list[str]]]:
    """Each ``$ offload-solve ...`` block of the README: its arguments and printed lines."""
    blocks: list[list[str]] = []
    inside = False
    for line in (PACKAGE / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
            if inside:
                blocks.append([])
        elif inside:
            blocks[-1].append(line)
    return [
        (shlex.split(block[0])[2:], block[1:])
        for block in blocks
        if block and block[0].startswith("$ offload-solve ")
    ]


def _without_solve_time(line: str) -> str:
    """The line with the machine-dependent solve time left out."""
    return re.sub(r"solved in [0-9.]+ s", "solved in _ s", line.rstrip())


def test_the_readme_profile_is_the_gpt_like_one() -> None:
    assert ModelProfile.from_json(PROFILE.read_text()) == gpt_like_profile()


def test_the_readme_shows_what_the_command_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = readme_runs()
    assert runs, "the README shows no offload-solve run"
    monkeypatch.chdir(REPO)  # the README's paths are the repository root's
    for args, shown in runs:
        assert main(args) == 0
        printed = capsys.readouterr().out.splitlines()
        assert [_without_solve_time(x) for x in printed] == [_without_solve_time(x) for x in shown]
