"""benchmarks/peer_training.py: the full-GPU peer's recipes on the CPU, a tiny batch."""

from __future__ import annotations

import pytest
from peer_training import run


@pytest.mark.parametrize("fp32_recipe", ["amp", "master"])
def test_fp16_state_loses_its_second_moments_and_fp32_state_keeps_them(fp32_recipe: str) -> None:
    fp16, _ = run("fp16_scaled", 3, 2, 64)
    amp, amp_skipped = run(fp32_recipe, 3, 2, 64)
    # Before the first step there is no state; after it fp16 rounds (1 - 0.999) * g**2 to 0.
    assert fp16[0].zero_second_moments is None and amp[0].zero_second_moments is None
    assert all(b.zero_second_moments is not None and b.zero_second_moments > 0.9 for b in fp16[1:])
    # (fp32 gradients under amp; "master" widens fp16 ones, a few of which are zero.)
    assert all(b.zero_second_moments is not None and b.zero_second_moments < 0.01 for b in amp[1:])
    # Adam divides by eps alone where the moment is zero: fp16's weights jump, amp's do not.
    assert fp16[-1].largest_weight > 1.5 * fp16[0].largest_weight
    assert amp[-1].largest_weight < 1.1 * amp[0].largest_weight
    assert amp[-1].loss < amp[0].loss and amp_skipped == 0
    assert {b.loss_scale for b in amp} == {65536.0}


def test_unscaled_has_no_scale_and_unknown_recipes_are_refused() -> None:
    befores, skipped = run("fp16_unscaled", 1, 1, 16)
    assert befores[0].loss_scale is None and skipped == 0
    with pytest.raises(ValueError, match="recipe 'bf16'"):
        run("bf16", 1, 1, 16)
