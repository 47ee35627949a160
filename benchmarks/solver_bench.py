"""Time the offload solver on GPT-2-shaped profiles (a script, not a test).

    PYTHONPATH=packages/offload-solver/src python benchmarks/solver_bench.py
    PYTHONPATH=packages/offload-solver/src python benchmarks/solver_bench.py \
        --layers 50 --budget 16GiB
    PYTHONPATH=packages/offload-solver/src python benchmarks/solver_bench.py --planner

It synthesises a profile shaped like gpt2_10b (hidden 4096, 16 heads, batch 64 x sequence
8, vocabulary 50257 with tied wte / lm_head): per layer about 54 operations as a traced
graph has them (layer norm, qkv matmul, the views and transposes of attention, score
matmul, scale, mask, softmax, dropout, value matmul, projection, residual add, MLP with
a decomposed tanh GELU, ...), with FLOPs and activation bytes from the shapes. It then
solves with the default (H200-like) hardware at a budget that forces offloading and
prints the solve time on one core and the number of full simulations.

``--planner`` solves as ``offload_runtime``'s planner does for fp16 training (see
:func:`planner_solves`): hidden 2048, batch 4 x sequence 512, 37 layers (about 2,000
operations) at 30 GiB and 183 layers (about 10,000) at 72 GiB (its least budget is
61.8 GiB) by default, each profile solved for both candidates (fp16 I/O with
speculative host steps, solved a second time with none speculating as where host memory
holds no undo buffers; conversions on the device with host steps after backward), with
streamed state and late host work; it prints each solve and the total per profile, with
the solver's progress lines. The synthetic profile splits into fewer regions than a
traced model of the same shape (29 against 182 at about 2,000 operations), so it solves
faster than the traced one.

Targets: the planner's solves of about 2,000 operations within 10 s on one
core, of about 10,000 operations within 60 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

from offload_solver import (
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    StatePlacement,
    StreamedStepCosts,
    default_hardware,
    parse_bytes,
    solve,
)

ELEM = 2  # fp16 bytes


def gpt2_profile(
    layers: int,
    hidden: int = 4096,
    heads: int = 16,
    batch: int = 64,
    seq: int = 8,
    *,
    host_grad_bytes_per_param: int = 2,
    host_upload_bytes_per_param: int = 0,
    vocab: int = 50257,
    positions: int = 1024,
) -> ModelProfile:
    """A synthetic trace of a GPT-2 training step (see the module docstring)."""
    tokens = batch * seq
    act = tokens * hidden * ELEM
    scores = batch * heads * seq * seq * ELEM
    head_dim = hidden // heads
    params: list[Parameter] = []
    ops: list[Operation] = []

    def param(name: str, *shape: int) -> str:
        numel = 1
        for d in shape:
            numel *= d
        params.append(Parameter(name, numel, numel * ELEM))
        return name

    def op(
        name: str,
        uses: tuple[str, ...] = (),
        out: int = 0,
        saved: int = 0,
        flop: int = 0,
        tmp: int = 0,
    ) -> None:
        # Backward: the incoming gradient is alive (tmp) and the input gradient is produced.
        ops.append(
            Operation(
                name=f"{name}_{len(ops)}",
                param_names=uses,
                fwd_out_bytes=out,
                fwd_tmp_bytes=tmp,
                saved_bytes=saved,
                bwd_tmp_bytes=out,
                bwd_out_bytes=out,
                fwd_flop=flop,
                bwd_flop=2 * flop,
            )
        )

    wte = param("wte.weight", vocab, hidden)
    wpe = param("wpe.weight", positions, hidden)
    param("lm_head.weight", vocab, hidden)
    op("embedding", (wte,), out=act, saved=tokens * 8)
    op("arange", out=tokens * 8)
    op("embedding", (wpe,), out=act, saved=tokens * 8)
    op("add", out=act, tmp=act)
    op("dropout", out=act, saved=act // 2)
    for i in range(layers):
        pre = f"h.{i}."
        ln1 = (param(pre + "ln_1.weight", hidden), param(pre + "ln_1.bias", hidden))
        qkv = (
            param(pre + "attn.c_attn.weight", hidden, 3 * hidden),
            param(pre + "attn.c_attn.bias", 3 * hidden),
        )
        proj = (
            param(pre + "attn.c_proj.weight", hidden, hidden),
            param(pre + "attn.c_proj.bias", hidden),
        )
        ln2 = (param(pre + "ln_2.weight", hidden), param(pre + "ln_2.bias", hidden))
        fc = (
            param(pre + "mlp.c_fc.weight", hidden, 4 * hidden),
            param(pre + "mlp.c_fc.bias", 4 * hidden),
        )
        fc_proj = (
            param(pre + "mlp.c_proj.weight", 4 * hidden, hidden),
            param(pre + "mlp.c_proj.bias", hidden),
        )
        op("layer_norm", ln1, out=act, saved=act + tokens * 8, flop=5 * tokens * hidden)
        op("view", tmp=act)
        op("addmm", qkv, out=3 * act, saved=act, flop=2 * tokens * hidden * 3 * hidden)
        op("view")
        for _ in range(3):
            op("split_getitem")
        for _ in range(3):
            op("view")
            op("transpose")
        op("transpose")
        op("expand")
        op("clone", out=act, tmp=act)
        op("bmm", out=scores, saved=2 * act, flop=2 * batch * heads * seq * seq * head_dim)
        op("view")
        op("div", out=scores, tmp=scores)
        op("slice")
        op("slice")
        op("where", out=scores, saved=scores // 2, tmp=scores)
        op("softmax", out=scores, saved=scores, flop=5 * batch * heads * seq * seq)
        op("dropout", out=scores, saved=scores // 2 + scores, tmp=scores)
        op("expand")
        op("bmm", out=act, saved=act, flop=2 * batch * heads * seq * seq * head_dim)
        op("view")
        op("transpose")
        op("clone", out=act, tmp=act)
        op("view")
        op("view")
        op("addmm", proj, out=act, saved=act, flop=2 * tokens * hidden * hidden)
        op("view")
        op("dropout", out=act, saved=act // 2, tmp=act)
        op("add", out=act, tmp=2 * act)
        op("layer_norm", ln2, out=act, saved=act + tokens * 8, flop=5 * tokens * hidden)
        op("view", tmp=act)
        op("addmm", fc, out=4 * act, saved=act, flop=2 * tokens * hidden * 4 * hidden)
        op("view")
        # tanh GELU, decomposed: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))
        for name in ("mul", "pow", "mul", "add", "mul", "tanh", "add", "mul"):
            op(name, out=4 * act, saved=2 * act, tmp=4 * act, flop=tokens * 4 * hidden)
        op("view")
        op("addmm", fc_proj, out=act, saved=4 * act, flop=2 * tokens * 4 * hidden * hidden)
        op("view")
        op("dropout", out=act, saved=act // 2, tmp=act)
        op("add", out=act, tmp=2 * act)
        op("view")
        op("view")
        op("detach")
        op("alias")
    ln_f = (param("ln_f.weight", hidden), param("ln_f.bias", hidden))
    logits = tokens * vocab * ELEM
    op("layer_norm", ln_f, out=act, saved=act + tokens * 8, flop=5 * tokens * hidden)
    op("view")
    op("mm", (wte,), out=logits, saved=act, flop=2 * tokens * hidden * vocab)
    op("view")
    op("log_softmax", out=2 * logits, saved=2 * logits, flop=5 * tokens * vocab)
    op("nll_loss", out=4, saved=tokens * 8)
    return ModelProfile(
        name=f"gpt2_{layers}layers_h{hidden}",
        parameters=tuple(params),
        operations=tuple(ops),
        tied_groups=(("wte.weight", "lm_head.weight"),),
        host_grad_bytes_per_param=host_grad_bytes_per_param,
        host_upload_bytes_per_param=host_upload_bytes_per_param,
    )


def bench(layers: int, budget: str, solver: str) -> None:
    profile = gpt2_profile(layers)
    hardware = default_hardware()
    t0 = time.perf_counter()
    plan = solve(profile, hardware, parse_bytes(budget), solver=solver)
    seconds = time.perf_counter() - t0
    n = len(plan.regions)
    offloaded = [rp for rp in plan.regions if rp.placement is not ParamPlacement.RESIDENT]
    n_async = sum(rp.placement is ParamPlacement.ASYNC for rp in plan.regions)
    n_device = sum(rp.state is StatePlacement.DEVICE for rp in plan.regions)
    print(
        f"{layers:>4} layers, {len(profile.operations):>6} ops, {n:>4} regions, "
        f"{profile.total_param_numel / 1e9:.2f}B params, budget {budget}, {solver}: "
        f"{seconds:.3f} s, {plan.num_simulations} simulations; "
        f"{len(offloaded)} offloaded ({n_async} async), {n_device} device-state; "
        f"peak {plan.predicted_peak_bytes / 2**30:.2f} GiB, "
        f"pool {plan.pool_size_bytes / 2**20:.0f} MiB, "
        f"step {plan.predicted_step_time_s * 1e3:.1f} ms",
        flush=True,
    )


def _streamed(up: int, down: int, slot_mib: int) -> StreamedStepCosts:
    """Streamed costs with the planner's staging: three 16 Mi-element chunks in backward."""
    return StreamedStepCosts(
        up_bytes_per_param=up,
        down_bytes_per_param=down,
        slot_bytes=slot_mib * 2**20,
        resident_down_bytes_per_param=12,
        staged_chunks=3,
        staged_chunk_numel=16 * 2**20,
        staged_bytes_per_param=12.0,
    )


SPECULATIVE_STREAMED = _streamed(14, 14, 832)
"""The streamed costs ``offload_runtime.planning.streamed_step_costs`` gives fp16 I/O with
bf16 moments at budgets from 12 GiB up (below, the ring is a share of the budget)."""
CONVERTING_STREAMED = _streamed(16, 12, 768)
"""The same for conversions on the device (fp32 masters up, fp32 gradients)."""
SPECULATIVE_STEP_COST = 1.15
"""The default hardware's speculative fp16 I/O step time over its plain one."""


def planner_solves(
    layers: int, hardware: HardwareProfile
) -> list[tuple[str, ModelProfile, HardwareProfile, dict[str, Any]]]:
    """(name, profile, hardware, ``solve`` keywords) of each solve ``offload_runtime``'s
    planner makes for fp16 training of a ``layers``-layer, hidden-2048 model (the example
    models' vocabulary of 1024) at batch 4 x
    sequence 512 (``planning.candidates``): fp16 I/O with speculative host steps on a
    thread (no conversion pass charged), then again with no region speculating (the
    planner's retry where host memory holds no undo buffers), and conversions on the
    device with host steps after backward."""
    shape = {"hidden": 2048, "heads": 16, "batch": 4, "seq": 512, "vocab": 1024}
    host_io = gpt2_profile(layers, **shape)
    on_device = gpt2_profile(
        layers, **shape, host_grad_bytes_per_param=4, host_upload_bytes_per_param=4
    )
    fp16_io = dataclasses.replace(hardware, host_convert_elems_per_s=0.0)
    speculative: dict[str, Any] = {
        "speculative_step_cost": SPECULATIVE_STEP_COST,
        "speculation_thread": True,
        "streamed": SPECULATIVE_STREAMED,
    }
    return [
        ("fp16 I/O, speculative", host_io, fp16_io, speculative),
        ("fp16 I/O, none speculating", host_io, fp16_io, {**speculative, "speculative_params": 0}),
        (
            "conversions on the device",
            on_device,
            hardware,
            {"host_step_after_backward": True, "streamed": CONVERTING_STREAMED},
        ),
    ]


def bench_planner(layers: int, budget: str, verbose: bool) -> None:
    """Each of :func:`planner_solves`' solves at ``budget``, timed, and their total."""
    total = 0.0
    ops = 0
    for name, profile, hardware, kwargs in planner_solves(layers, default_hardware()):
        ops = len(profile.operations)
        say = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if verbose else None
        t0 = time.perf_counter()
        plan = solve(profile, hardware, parse_bytes(budget), progress=say, **kwargs)
        seconds = time.perf_counter() - t0
        total += seconds
        print(
            f"{layers:>4} layers, {ops:>6} ops, {len(plan.regions):>4} regions, budget "
            f"{budget}, {name}: {seconds:.2f} s, {plan.num_simulations} simulations, step "
            f"{plan.predicted_step_time_s * 1e3:.3f} ms, peak "
            f"{plan.predicted_peak_bytes / 2**30:.2f} GiB",
            flush=True,
        )
    print(f"{layers:>4} layers, {ops:>6} ops: the planner's solves took {total:.2f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="*", default=[50, 200])
    p.add_argument(
        "--budget",
        nargs="*",
        default=None,
        help="one budget per --layers entry (default: 16GiB for 50 layers, 48GiB for 200)",
    )
    p.add_argument("--solver", default="asyn")
    p.add_argument(
        "--planner",
        action="store_true",
        help="solve as the runtime's planner does (default layers 37 at 30GiB, 183 at 72GiB)",
    )
    p.add_argument("--quiet", action="store_true", help="no solver progress lines")
    args = p.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, as the target says
    if args.planner:
        layers = args.layers if args.layers != [50, 200] else [37, 183]
        budgets = args.budget or ["30GiB" if n <= 37 else "72GiB" for n in layers]
        for n, budget in zip(layers, budgets, strict=True):
            bench_planner(n, budget, not args.quiet)
        return
    budgets = args.budget or ["16GiB" if n <= 50 else "48GiB" for n in args.layers]
    for layers, budget in zip(args.layers, budgets, strict=True):
        bench(layers, budget, args.solver)


if __name__ == "__main__":
    main()
