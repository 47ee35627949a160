"""Single-pass host Adam threads claim blocks from a shared counter ([Note: blocks claimed
as threads free up] in _numba_adam.py): every kernel's result must not depend on how many
threads claimed the blocks, nor in which order. That the kernels compute torch's Adam is
checked in test_speculate.py and test_fp16_io.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from offload_runtime.host_kernels import AdamHyper, single_pass

pytestmark = pytest.mark.skipif(
    not single_pass.fp16_io_available(), reason="numba or the CPU's fp16 conversions missing"
)

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)


@pytest.fixture
def threads() -> Iterator[int]:
    """torch's intra-op thread count, which the kernels launch with; restored after."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def _every_kernel(n: int) -> list[torch.Tensor]:
    """Each of the four kernels once on the same seeded state (a NaN in the speculative
    ones' last block), every output tensor."""
    gen = torch.Generator().manual_seed(0)
    out: list[torch.Tensor] = []
    step = torch.tensor(3.0)
    scale = torch.tensor(128.0)
    for speculative in (False, True):
        for fp16 in (False, True):
            p = torch.randn(n, generator=gen)
            m = torch.randn(n, generator=gen) * 1e-3
            v = torch.rand(n, generator=gen) * 1e-6
            g = torch.randn(n, generator=gen) * 100
            if speculative:
                g[-1] = float("nan")
            g16 = g.half()
            p16 = torch.empty(n, dtype=torch.float16)
            m2, v2, bak = torch.empty(n), torch.empty(n), torch.empty(n)
            if speculative and fp16:
                part = single_pass.speculative_adam_fp16_io_(
                    p, g16, m, v, m2, v2, bak, p16, step, HYPER, scale
                )
                out += [part, m2, v2, bak, p16]
            elif speculative:
                part = single_pass.speculative_adam_(p, g, m, v, m2, v2, bak, step, HYPER, scale)
                out += [part, m2, v2, bak, g]
            elif fp16:
                single_pass.adam_fp16_io_(p, g16, m, v, p16, step, HYPER, scale)
                out += [m, v, p16]
            else:
                single_pass.adam_(p, g, m, v, step, HYPER, scale)
                out += [m, v, g]
            out.append(p)
    return out


@pytest.mark.parametrize("n", [1, 5 * (1 << 16) + 17])
def test_results_do_not_depend_on_the_threads_that_claim_the_blocks(n: int, threads: int) -> None:
    torch.set_num_threads(1)
    want = _every_kernel(n)  # one thread claims every block, in order
    specs = [t for t in want if t.dim() == 0]
    assert [t.item() for t in specs] == [float("inf")] * 2  # both speculative steps saw the NaN
    torch.set_num_threads(max(2, threads))  # threads claim blocks as they free up
    got = _every_kernel(n)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), n
