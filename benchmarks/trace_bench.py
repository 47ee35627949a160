"""How long tracing a large GPT-2 on the meta device takes, and how much memory it needs.

    PYTHONPATH=packages/offload-solver/src:packages/offload-trace/src \
        python benchmarks/trace_bench.py                      # gpt2_10b, batch 16, seq 8
    python benchmarks/trace_bench.py --model gpt2_24b --batch 4 --seq 1024
    python benchmarks/trace_bench.py --workload W3 --fuse-gelu   # the bench's W3, GELU fused

Builds the model under ``torch.device("meta")`` (no weights), traces it with
``offload_trace.trace`` (export + forward/backward cost run on meta) and converts it to a
``ModelProfile``. Prints the seconds of each phase and the process's peak resident memory.
Targets for gpt2_10b on a 2-core CPU: under 30 s and under 2 GB.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from offload_trace import trace

# -- config ---------------------------------------------------------------------------
SIZES = {  # hidden, layers, heads; vocab 1024 as in the reference example
    "gpt2_medium": (1024, 24, 16),
    "gpt2_xl": (1600, 48, 32),
    "gpt2_10b": (4096, 50, 16),
    "gpt2_14b": (4096, 70, 16),
    "gpt2_20b": (8192, 25, 16),
    "gpt2_24b": (8192, 30, 16),
}
VOCAB = 1024


class LogitsOnly(nn.Module):
    """``forward(input_ids, attention_mask) -> logits`` around a Hugging Face LM."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits: torch.Tensor = out.logits
        return logits


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="gpt2_10b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--target", default="cuda", help="device whose kernels to cost")
    parser.add_argument(
        "--workload",
        choices=("W1", "W2", "W3", "W4"),
        default=None,
        help="trace offload_bench.py's workload instead (its model, batch and sequence, "
        "called without an attention mask, as the bench runs it); --model, --batch and "
        "--seq are then not used",
    )
    parser.add_argument(
        "--fuse-gelu",
        action="store_true",
        help="trace with the written-out tanh GELU fused into one aten.gelu (trace(fuse_gelu=))",
    )
    args = parser.parse_args()

    if args.workload is not None:
        _trace_workload(args.workload, args.fuse_gelu)
        return
    hidden, layers, heads = SIZES[args.model]
    t0 = time.perf_counter()
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        config = GPT2Config(
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            vocab_size=VOCAB,
            n_positions=max(1024, args.seq),
            bos_token_id=0,
            eos_token_id=0,
        )
        model = LogitsOnly(GPT2LMHeadModel(config))
    t1 = time.perf_counter()
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    traced = trace(
        model,
        {"input_ids": ids, "attention_mask": ids},
        target_device=args.target,
        fuse_gelu=args.fuse_gelu,
    )
    t2 = time.perf_counter()
    profile = traced.to_profile(args.model)
    text = profile.to_json()
    t3 = time.perf_counter()

    params = profile.total_param_numel
    tokens = args.batch * args.seq
    print(
        f"model            {args.model} ({params / 1e9:.2f} B parameters), batch "
        f"{args.batch} x seq {args.seq}, fp16, costs for {args.target}"
    )
    print(f"build on meta    {t1 - t0:6.2f} s")
    fused = f", {len(traced.fused_gelu)} GELUs fused" if args.fuse_gelu else ""
    print(f"trace + costs    {t2 - t1:6.2f} s  ({len(profile.operations)} operations{fused})")
    print(f"to_profile+json  {t3 - t2:6.2f} s  ({len(text) / 1e6:.1f} MB of JSON)")
    print(f"total            {t3 - t0:6.2f} s")
    print(f"peak RSS         {peak_rss_bytes() / 1e9:6.2f} GB")
    print(
        f"saved for bwd    {traced.saved_bytes / 2**30:6.2f} GiB, forward peak "
        f"{traced.forward_peak_bytes / 2**30:.2f} GiB, backward peak "
        f"{traced.backward_peak_bytes / 2**30:.2f} GiB"
    )
    print(
        f"FLOPs fwd+bwd    {(traced.fwd_flop + traced.bwd_flop) / (6 * params * tokens):.4f}"
        " x 6 * params * tokens"
    )


def _trace_workload(workload: str, fuse_gelu: bool) -> None:
    """``--workload``: trace one of offload_bench.py's workloads as replay_bench.py does."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offload_bench import WORKLOADS
    from replay_bench import workload_traced

    name, batch, seq, _ = WORKLOADS[workload]
    t0 = time.perf_counter()
    traced = workload_traced(workload, fuse_gelu=fuse_gelu)
    fused = f", {len(traced.fused_gelu)} GELUs fused" if fuse_gelu else ""
    print(f"workload         {workload}: {name}, batch {batch} x seq {seq}, fp16, costs for cuda")
    print(
        f"build + trace    {time.perf_counter() - t0:6.2f} s  "
        f"({len(traced.operation_names)} operations{fused})"
    )
    print(
        f"saved for bwd    {traced.saved_bytes / 2**20:9.1f} MiB, forward peak "
        f"{traced.forward_peak_bytes / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
