"""What the planner predicts for a workload, on any machine (nothing is allocated).

    python benchmarks/plan_predict.py --model gpt2_xl --batch 64 --seq 8 --budget-gib 3
    python benchmarks/plan_predict.py --model gpt2_6b --batch 4 --seq 512 --budget-gib 24

Traces the example zoo's model on the meta device for CUDA, solves with an H200-like
hardware profile (``offload_solver.default_hardware()`` with the per-operation cost, host
conversion rate and host Adam rate given here; defaults as measured on the H200, see
BENCHMARKS.md; ``--h2d-gbps`` / ``--d2h-gbps`` / ``--peak-tflops`` / ``--efficiency``
replace the copy rates and compute rate with a measured profile's), and prints: how many
attention nodes the causal rewrite turned into ``is_causal=True`` and the bytes saved for
backward, and how many tanh GELUs were fused into one ``aten.gelu`` (``--no-fuse-gelu``
traces them as written); the plan's placements and optimizer-state placements (one letter
per region); its predicted step (the steady-state period) and peak, and the single cold step's span
(what the plan's timeline shows) with the peak of the repeating step; and the pinned host
memory the runtime will need. A budget below the least feasible one prints that least
budget instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload_solver import HardwareProfile

GiB = 2**30


def replay_hardware(
    *,
    op_overhead_us: float,
    host_convert_gelem: float,
    host_adam_gparam: float = 0.0,
    h2d_gbps: float = 0.0,
    d2h_gbps: float = 0.0,
    peak_tflops: float = 0.0,
    efficiency: float = 0.0,
    hbm_tbps: float | None = None,
    host_copy_contention: float | None = None,
) -> HardwareProfile:
    """``offload_solver.default_hardware()`` with a measured profile's figures (as
    ``offload_bench.py`` records them per row); 0 (or None) keeps the default's. The copy
    rates scale the default bandwidth curve: its shape (latency-bound small copies) is
    kept, its plateau moved to the given rate."""
    from offload_solver import BandwidthPoint
    from offload_solver.hardware import default_hardware

    hw = dataclasses.replace(
        default_hardware(),
        op_overhead_s=op_overhead_us * 1e-6,
        host_convert_elems_per_s=host_convert_gelem * 1e9,
    )
    if host_adam_gparam > 0:
        hw = dataclasses.replace(hw, host_adam_params_per_s=host_adam_gparam * 1e9)

    def scaled(points: tuple[BandwidthPoint, ...], gbps: float) -> tuple[BandwidthPoint, ...]:
        factor = gbps * 1e9 / points[-1].bytes_per_s
        return tuple(BandwidthPoint(p.size_bytes, p.bytes_per_s * factor) for p in points)

    if h2d_gbps > 0:
        hw = dataclasses.replace(hw, h2d=scaled(hw.h2d, h2d_gbps))
    if d2h_gbps > 0:
        hw = dataclasses.replace(hw, d2h=scaled(hw.d2h, d2h_gbps))
    if peak_tflops > 0:
        hw = dataclasses.replace(hw, compute_flop_per_s=peak_tflops * 1e12)
    if efficiency > 0:
        hw = dataclasses.replace(hw, compute_efficiency=efficiency)
    if hbm_tbps is not None:
        hw = dataclasses.replace(hw, device_memory_bytes_per_s=hbm_tbps * 1e12)
    if host_copy_contention is not None:
        hw = dataclasses.replace(hw, host_copy_contention=host_copy_contention)
    return hw


def add_compute_model_args(parser: argparse.ArgumentParser, what: str) -> None:
    """``--issue-ahead`` and ``--attention-fwd`` / ``--attention-bwd`` (TFLOP/s): the
    compute model's options, off by default ([Note: issuing ahead] in the solver's engine,
    ``HardwareProfile.attention_fwd_flop_per_s``); ``what`` begins each help text."""
    parser.add_argument(
        "--issue-ahead",
        action="store_true",
        help=f"{what} with HardwareProfile.issue_ahead (the host issues ahead of the "
        "device; operations that launch nothing cost it nothing where it is behind)",
    )
    for side in ("fwd", "bwd"):
        parser.add_argument(
            f"--attention-{side}",
            type=float,
            default=0.0,
            metavar="TFLOPS",
            help=f"{what} with fused attention's {side} at this rate "
            f"(HardwareProfile.attention_{side}_flop_per_s; 0: the matmul rate)",
        )


def with_compute_model(hw: HardwareProfile, args: argparse.Namespace) -> HardwareProfile:
    """``hw`` with the options :func:`add_compute_model_args` parsed into ``args``."""
    return dataclasses.replace(
        hw,
        issue_ahead=hw.issue_ahead or bool(args.issue_ahead),
        attention_fwd_flop_per_s=args.attention_fwd * 1e12 or hw.attention_fwd_flop_per_s,
        attention_bwd_flop_per_s=args.attention_bwd * 1e12 or hw.attention_bwd_flop_per_s,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_xl")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--budget-gib", type=float, default=3.0)
    parser.add_argument("--solver", default="asyn", choices=("syn", "asyn"))
    parser.add_argument("--op-overhead-us", type=float, default=15.0)
    parser.add_argument("--host-convert-gelem", type=float, default=11.0)
    parser.add_argument("--host-adam-gparam", type=float, default=0.0, help="0: the default")
    parser.add_argument(
        "--h2d-gbps",
        type=float,
        default=0.0,
        help="large-copy H2D rate in GB/s: scales the default curve to it (0: the default)",
    )
    parser.add_argument("--d2h-gbps", type=float, default=0.0, help="as --h2d-gbps, for D2H")
    parser.add_argument(
        "--peak-tflops", type=float, default=0.0, help="matmul peak in TFLOP/s (0: the default)"
    )
    parser.add_argument(
        "--efficiency", type=float, default=0.0, help="fraction of the peak reached (0: default)"
    )
    parser.add_argument(
        "--hbm-tbps",
        type=float,
        default=None,
        help="device memory bandwidth in TB/s (read + write) for memory-bound operations "
        "(omitted: the default profile's; 0: unknown, operations priced by FLOPs and issue "
        "cost alone)",
    )
    parser.add_argument(
        "--convert",
        default="both",
        choices=("host", "device", "both"),
        help="where host-state regions change dtype (memory_optimize's convert_on_device); "
        "both: plan each and print both",
    )
    parser.add_argument(
        "--host-copy-contention",
        type=float,
        default=None,
        help="fraction of its rate host optimizer work keeps while pinned copies run "
        "(omitted: the default profile's; 1: none)",
    )
    parser.add_argument(
        "--speculative-step-cost",
        type=float,
        default=1.0,
        help="with --speculate: a step taken under backward costs this many plain ones",
    )
    parser.add_argument(
        "--in-use-mib",
        type=float,
        default=0.0,
        help="device memory in use beside the plan, MiB (solve's device_bytes_in_use)",
    )
    parser.add_argument("--with-mask", action="store_true", help="pass an all-ones mask")
    parser.add_argument(
        "--no-fuse-gelu",
        action="store_true",
        help="trace GPT-2's tanh GELU as written (default: fused into one aten.gelu, as "
        "memory_optimize does by default)",
    )
    parser.add_argument(
        "--speculate",
        action="store_true",
        help="host steps run as gradients land (bf16, or fp16 with speculate_fp16=True); "
        "default: after backward, as fp16 needs the overflow answer first",
    )
    args = parser.parse_args(argv)

    import torch

    from offload_gpt_example.models import build_model, random_batch
    from offload_runtime.api import device_conversion_profile
    from offload_runtime.storage import required_host_bytes
    from offload_solver import (
        InfeasibleBudgetError,
        RegionAssignment,
        SimulationContext,
        StatePlacement,
        get_simulator,
        solve,
    )
    from offload_solver.simulators._engine import steady_state
    from offload_trace import trace

    model = build_model(args.model, device="meta", dtype=torch.float16, seq_len=args.seq)
    inputs = random_batch(args.batch, args.seq, device="meta")
    if args.with_mask:
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    traced = trace(
        model, inputs, dtype=torch.float16, target_device="cuda", fuse_gelu=not args.no_fuse_gelu
    )
    profile = traced.to_profile()
    print(
        f"{args.model} {args.batch}x{args.seq}: {profile.total_param_numel / 1e9:.2f} G params, "
        f"{len(traced.causal_attention)} attention nodes rewritten to is_causal, "
        f"{len(traced.fused_gelu)} GELUs fused, "
        f"saved for backward {traced.saved_bytes / GiB:.2f} GiB"
    )
    hw = replay_hardware(
        op_overhead_us=args.op_overhead_us,
        host_convert_gelem=args.host_convert_gelem,
        host_adam_gparam=args.host_adam_gparam,
        h2d_gbps=args.h2d_gbps,
        d2h_gbps=args.d2h_gbps,
        peak_tflops=args.peak_tflops,
        efficiency=args.efficiency,
        hbm_tbps=args.hbm_tbps,
        host_copy_contention=args.host_copy_contention,
    )
    print(
        f"hardware: H2D {hw.h2d[-1].bytes_per_s / 1e9:.1f} GB/s, D2H "
        f"{hw.d2h[-1].bytes_per_s / 1e9:.1f} GB/s (1 GB copies), compute "
        f"{hw.compute_flop_per_s / 1e12:.0f} TFLOP/s x {hw.compute_efficiency}, host Adam "
        f"{hw.host_adam_params_per_s / 1e9:.2f} Gparam/s, host conversion "
        f"{hw.host_convert_elems_per_s / 1e9:.1f} Gelem/s, {hw.op_overhead_s * 1e6:.1f} us/op, "
        f"device memory {hw.device_memory_bytes_per_s / 1e12:.1f} TB/s, host work under "
        f"copies x{hw.host_copy_contention:.2f}"
    )
    fwd_s = sum(hw.op_time_s(op.fwd_flop, op.fwd_traffic_bytes) for op in profile.operations)
    bwd_s = sum(hw.op_time_s(op.bwd_flop, op.bwd_traffic_bytes) for op in profile.operations)
    print(
        f"compute alone (every operation back to back): forward {fwd_s * 1e3:.1f} ms, "
        f"backward {bwd_s * 1e3:.1f} ms"
    )
    modes = ("host", "device") if args.convert == "both" else (args.convert,)
    status = 0
    for mode in modes:
        on_device = mode == "device"
        variant = device_conversion_profile(profile) if on_device else profile
        print(f"-- dtype conversion on the {mode}")
        try:
            plan = solve(
                variant,
                hw,
                int(args.budget_gib * GiB),
                solver=args.solver,
                host_step_after_backward=not args.speculate,
                speculative_step_cost=args.speculative_step_cost,
                device_bytes_in_use=int(args.in_use_mib * 2**20),
            )
        except InfeasibleBudgetError as exc:
            print(f"infeasible: least budget {exc.least_budget_bytes / 1e9:.2f} GB")
            status = 1
            continue
        print("placements", "".join(rp.placement.value[0] for rp in plan.regions))
        print("states    ", "".join(rp.state.value[0] for rp in plan.regions))
        pinned = required_host_bytes(plan, torch.float16, convert_on_device=on_device)
        print(
            f"{len(plan.regions)} regions; predicted step {plan.predicted_step_time_s * 1e3:.1f} "
            f"ms, peak {plan.predicted_peak_bytes / GiB:.2f} GiB of {args.budget_gib} GiB; "
            f"host memory for region state {pinned / GiB:.1f} GiB"
        )
        # The plan's step is the steady-state period; its timeline is one cold step.
        ctx = SimulationContext.build(
            variant,
            hw,
            host_step_after_backward=not args.speculate,
            speculative_step_cost=args.speculative_step_cost,
        )
        asg = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
        cold = get_simulator("async").run(ctx, asg)
        steady = steady_state(ctx, asg, cold)
        spans = ", ".join(f"{p * 1e3:.1f}" for p in steady.periods_s)
        print(
            f"single cold step {cold.step_time_s * 1e3:.1f} ms (compute lane {spans} ms in "
            f"consecutive steps, {'' if steady.converged else 'not '}converged); peak of the "
            f"repeating step {steady.last.peak_bytes / GiB:.2f} GiB"
        )
        # The pinned fp32 masters and gradients as exact-size buffers (the runtime's
        # in-place pinning) and as PyTorch's caching host allocator would round them (each
        # buffer up to a power of two).
        exact = rounded = 0
        for rp in plan.regions:
            if rp.state is StatePlacement.HOST:
                nbytes = 4 * rp.region.numel
                exact += 2 * nbytes
                rounded += 2 * (1 << (nbytes - 1).bit_length())
        print(
            f"fp32 masters + gradients: {exact / GiB:.1f} GiB exact, {rounded / GiB:.1f} GiB "
            f"with power-of-two rounding (x{rounded / max(exact, 1):.2f})"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
