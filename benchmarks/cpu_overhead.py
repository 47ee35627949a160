"""Per-step CPU overhead of an offloaded training step against plain PyTorch, on the CPU.

    python benchmarks/cpu_overhead.py            # 24-layer tiny GPT-2, batch 2 x 8
    python benchmarks/cpu_overhead.py --layers 48 --steps 30

A tiny GPT-2 (hidden 32) whose step is dominated by issuing operations, not by arithmetic,
trained two ways on one CPU thread: plain ``torch.optim.Adam(fused=True)`` over the model,
and ``memory_optimize`` (fp32, a budget with room for everything, finest regions) with
``AMPOptimizer(HybridAdam)``. Every region then stays resident with its optimizer state
on the device, like workload W1 on a GPU, so the difference is the runtime's and the
optimizer's own per-step Python and launches. Prints medians of alternating rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from offload_optim import AMPOptimizer, HybridAdam
    from offload_runtime import memory_optimize
    from offload_runtime.hardware import default_cpu_profile

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPT2Config(
        vocab_size=1024,
        n_positions=16,
        n_embd=32,
        n_layer=args.layers,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
    )

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = GPT2LMHeadModel(cfg)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            logits: torch.Tensor = self.m(input_ids=input_ids).logits
            return logits

    def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    model = LM()
    ids = torch.randint(0, 1024, (2, 8))
    inp = {"input_ids": ids}
    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=1e-4, fused=True)
    module = memory_optimize(
        model,
        inp,
        2**34,
        "asyn",
        dtype=torch.float32,
        hardware=default_cpu_profile(),
        progress=False,
        block_search_range_bytes=0,
    )
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-4), module)

    def plain() -> None:
        loss_of(plain_model(**inp), ids).backward()  # type: ignore[no-untyped-call]
        plain_opt.step()
        plain_opt.zero_grad()

    def ours() -> None:
        amp.zero_grad()
        amp.backward(loss_of(module(**inp), ids))
        amp.step()

    def median_ms(step: Callable[[], None]) -> float:
        for _ in range(3):
            step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    results: dict[str, list[float]] = {"plain": [], "ours": []}
    for _ in range(args.rounds):
        results["plain"].append(median_ms(plain))
        results["ours"].append(median_ms(ours))
    p = statistics.median(results["plain"])
    o = statistics.median(results["ours"])
    print(
        f"{len(module.plan.regions)} regions, {args.layers} layers: plain {p:.2f} ms, "
        f"ours {o:.2f} ms per step ({o / p:.2f}x)"
    )
    module.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
