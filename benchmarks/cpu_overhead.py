"""Per-step CPU overhead of an offloaded training step against plain PyTorch, on the CPU.

    python benchmarks/cpu_overhead.py            # 24-layer tiny GPT-2, batch 2 x 8
    python benchmarks/cpu_overhead.py --layers 48 --steps 30
    python benchmarks/cpu_overhead.py --probe     # also the op-overhead probe, 5 reads

A tiny GPT-2 (hidden 32) whose step is dominated by issuing operations, not by arithmetic,
trained two ways on one CPU thread: plain ``torch.optim.Adam(fused=True)`` over the model,
and ``memory_optimize`` (fp32, a budget with room for everything, finest regions) with
``AMPOptimizer(HybridAdam)``. Every region then stays resident with its optimizer state
on the device, like workload W1 on a GPU, so the difference is the runtime's and the
optimizer's own per-step Python and launches. Prints medians of alternating rounds, for
the whole step and for its forward (loss included), backward and optimizer step, and how
many ``nn.Module.__getattr__`` calls one forward makes (the rewritten graph's parameter
reads: ``offload_runtime.attr_reads``). ``--probe`` also prints
``offload_runtime.hardware.measure_op_overhead_s`` read 5 times on this CPU, sorted.
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
    parser.add_argument("--probe", action="store_true", help="read the op-overhead probe too")
    args = parser.parse_args(argv)

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from offload_optim import AMPOptimizer, HybridAdam
    from offload_runtime import memory_optimize
    from offload_runtime.hardware import default_cpu_profile, measure_op_overhead_s

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

    Phases = tuple[float, float, float]  # forward (with the loss), backward, step: seconds

    def plain() -> Phases:
        t0 = time.perf_counter()
        loss = loss_of(plain_model(**inp), ids)
        t1 = time.perf_counter()
        loss.backward()  # type: ignore[no-untyped-call]
        t2 = time.perf_counter()
        plain_opt.step()
        plain_opt.zero_grad()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def ours() -> Phases:
        t0 = time.perf_counter()
        amp.zero_grad()
        loss = loss_of(module(**inp), ids)
        t1 = time.perf_counter()
        amp.backward(loss)
        t2 = time.perf_counter()
        amp.step()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def medians_ms(step: Callable[[], Phases]) -> list[float]:
        """Whole step, forward, backward, optimizer step: medians over ``--steps``."""
        for _ in range(3):
            step()
        phases = [step() for _ in range(args.steps)]
        return [
            statistics.median(sum(p) for p in phases) * 1e3,
            *(statistics.median(p[i] for p in phases) * 1e3 for i in range(3)),
        ]

    def getattr_calls(forward: Callable[[], object]) -> int:
        calls = 0
        original = torch.nn.Module.__getattr__

        def counting(self: torch.nn.Module, name: str) -> object:
            nonlocal calls
            calls += 1
            return original(self, name)

        torch.nn.Module.__getattr__ = counting  # type: ignore[method-assign,assignment]
        try:
            with torch.no_grad():
                forward()
        finally:
            torch.nn.Module.__getattr__ = original  # type: ignore[method-assign]
        return calls

    results: dict[str, list[list[float]]] = {"plain": [], "ours": []}
    for _ in range(args.rounds):
        results["plain"].append(medians_ms(plain))
        results["ours"].append(medians_ms(ours))
    p, o = ([statistics.median(r[i] for r in results[k]) for i in range(4)] for k in results)
    print(
        f"{len(module.plan.regions)} regions, {args.layers} layers: plain {p[0]:.2f} ms, "
        f"ours {o[0]:.2f} ms per step ({o[0] / p[0]:.2f}x)"
    )
    for i, phase in enumerate(("forward", "backward", "step"), start=1):
        print(f"  {phase}: plain {p[i]:.2f} ms, ours {o[i]:.2f} ms")
    print(
        "  nn.Module.__getattr__ calls per forward: "
        f"plain {getattr_calls(lambda: plain_model(**inp))}, "
        f"ours {getattr_calls(lambda: module(**inp))}"
    )
    if args.probe:
        reads = sorted(measure_op_overhead_s("cpu") * 1e6 for _ in range(5))
        print("  op-overhead probe (us per operation): " + ", ".join(f"{r:.2f}" for r in reads))
    module.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
