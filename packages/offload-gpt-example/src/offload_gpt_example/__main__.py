"""Train GPT-2 (or Llama) on one GPU under a memory budget, with the offload plan chosen
automatically.

Run it (defaults are the reference's: gpt2_medium, batch 64, 16 GB, the asyn solver):

    python -m offload_gpt_example
    python -m offload_gpt_example --model_type gpt2_10b --batch_size 16 --memory_budget 24
    MODEL_TYPE=gpt2_xl MEMORY_BUDGET=8 bash packages/offload-gpt-example/run.sh   # logged
    python -m offload_gpt_example --model_type gpt2_xl --memory_budget 3
    python -m offload_gpt_example --model_type gpt2_6b --batch_size 4 --seq_len 512 \
        --memory_budget 24 --host_state bf16_moments

The flags choose what changes the numbers trained (``--dtype``, ``--host_state``,
``--no_fuse_gelu``) and the run's shape; everything that only changes speed (where each
region's parameters and optimizer state live, the host kernel, fp16 I/O, speculative host
steps, streamed state) is the planner's (``offload_runtime.memory_optimize``), and the
log names what it chose: a ``plan:`` line and a table of the regions.

Several processes train data-parallel when ``torchrun`` starts them (gloo on the CPU,
NCCL on GPUs, one GPU a process): every rank draws its own batches, the gradients are
averaged over the ranks, each rank keeps and steps the host optimizer state of its own
regions, and the log says the world size and which regions each rank owns
(``offload_runtime.distributed``); rank 0 writes the plan files, and every rank its share
of a checkpoint (a directory: ``--resume`` takes it on any number of ranks):

    torchrun --standalone --nproc_per_node=2 -m offload_gpt_example --device cpu \
        --model_type gpt2_tiny --steps 3

Plan only, on any machine (the model is built on the meta device; no weights allocated):

    python -m offload_gpt_example --model_type gpt2_24b --plan_only

``--plan_only`` prints the plan a training run with the same flags would use on this
machine (``offload_runtime.plan``). Without a GPU, ``--device auto`` (the default) trains
gpt2_tiny at a small batch on the CPU instead and says so, and plans the model you name
for the default GPU (``offload_solver.default_hardware()``); ``--device cpu`` trains the
model you name on the CPU. A CPU run plans for the default GPU's profile too.

What it prints, in the reference's words (MB = 2**20 bytes, GB = 2**30 bytes):

    init_param_size=... MB | init_model_time=... s
    act_peak_mem=... MB | max_param_mem=... MB | total_param_mem=... MB
    plan: <the options the planner chose>
    <a table of the regions: parameters resident or offloaded, optimizer state, speculation>
    solver_time=... s
    | exec_time=... s | param_size=... MB | runtime_peak_mem_alc=... MB| \
runtime_peak_mem_res=... MB|
    predicted_peak_mem=... MB | runtime_peak_mem_alc=... MB | \
predicted_step_time=... s | exec_time=... s

``exec_time`` is the mean of the 5 fastest training steps; unlike the reference, a step
includes the optimizer step. ``solver_time`` covers tracing, hardware profiling (cached
per device) and solving. On the CPU the runtime peaks are 0: there is no CUDA allocator
to ask. Beside the log (``--log_dir``) it writes the plan as JSON and a PNG of the
simulated step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from offload_gpt_example.interrupt import StopOnInterrupt, load_checkpoint, save_checkpoint
from offload_gpt_example.models import (
    WithLMLoss,
    build_model,
    get_spec,
    model_names,
    parameter_bytes,
    random_batch,
)
from offload_gpt_example.plot import save_plan_png
from offload_optim import AMPOptimizer, HybridAdam, check_backward_issue, check_host_rate
from offload_runtime import (
    OffloadConfig,
    OffloadModule,
    describe_plan,
    memory_optimize,
    plan,
    summary_line,
)
from offload_solver import (
    BF16_MASTER_STATES,
    HOST_STATES,
    HardwareProfile,
    InfeasibleBudgetError,
    Plan,
    default_hardware,
    write_atomic,
)

# -----------------------------------------------------------------------------
# config (the reference's defaults; every one is a command-line flag)
MODEL_TYPE = "gpt2_medium"
BATCH_SIZE = 64
MEMORY_BUDGET_GB = 16.0  # GB = 1024**3 bytes, as in the reference
SOLVER_TYPE = "asyn"  # "asyn": prefetch on the H2D stream; "syn": upload when needed
SEQ_LEN = 8
DTYPE = "fp16"  # fp16 (loss scaling), bf16, or fp32 (exact; for CPU tests)
STEPS = 10
ACCUMULATION_STEPS = 1  # micro-batches of BATCH_SIZE per optimizer step
DEVICE = "auto"  # auto: CUDA when present, else the CPU fallback below
LOG_DIR = "offload_logs"
LEARNING_RATE = 1e-3
DROPOUT = 0.0  # HF's default is 0.1; 0 keeps the steps of a benchmark comparable
SEED = 0
# What --device auto trains when there is no GPU: big enough to exercise every part of the
# pipeline, small enough for a laptop.
CPU_FALLBACK_MODEL = "gpt2_tiny"
CPU_FALLBACK_BATCH = 4
FASTEST_STEPS = 5  # exec_time is the mean of this many fastest steps
# The host_adam line at the end reads the host's busy time over at most this many of the
# last steps (the first step, which allocates, left out).
HOST_CHECK_STEPS = 20
# -----------------------------------------------------------------------------

MB = 1024**2
GB = 1024**3
SOLVERS = ("asyn", "syn")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
EXIT_USAGE = 2  # argparse's code for a bad command line
EXIT_FAILURE = 1  # a valid command that cannot run here (no CUDA, budget too small)
EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (128 + SIGINT), the shell's convention


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(
        prog="offload-gpt-example",
        description="Train GPT-2 under a GPU memory budget with automatic parameter offload. "
        "The flags choose what changes the numbers trained and the run's shape; the planner "
        "chooses everything that only changes speed, and the log names what it chose.",
    )
    p.add_argument(
        "--model_type",
        default=MODEL_TYPE,
        help=f"one of {', '.join(model_names())} (default {MODEL_TYPE})",
    )
    p.add_argument("--batch_size", type=int, default=BATCH_SIZE)
    p.add_argument(
        "--memory_budget",
        type=float,
        default=MEMORY_BUDGET_GB,
        help=f"device memory budget in GB of 1024**3 bytes (default {MEMORY_BUDGET_GB:g})",
    )
    p.add_argument("--solver_type", choices=SOLVERS, default=SOLVER_TYPE)
    p.add_argument("--seq_len", type=int, default=SEQ_LEN)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=DTYPE)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument(
        "--accumulation_steps",
        type=int,
        default=ACCUMULATION_STEPS,
        help="micro-batches of --batch_size per optimizer step (gradient accumulation; each "
        "micro-batch's loss is divided by it); planned for, and timed per optimizer step "
        f"(default {ACCUMULATION_STEPS})",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default=DEVICE)
    p.add_argument(
        "--plan_only",
        action="store_true",
        help="trace on the meta device, solve, write the plan and its picture; no training. "
        "The plan is the one a training run with the same flags uses on this machine",
    )
    p.add_argument("--log_dir", default=LOG_DIR, help="folder for the plan JSON and PNG")
    p.add_argument("--lr", type=float, default=LEARNING_RATE)
    p.add_argument("--dropout", type=float, default=DROPOUT)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument(
        "--host_state",
        choices=HOST_STATES,
        default="fp32",
        help="precision of host-resident optimizer state (OffloadConfig.host_state): fp32 "
        "master and moments; bf16_moments; bf16_stochastic (bf16 master, stochastic "
        "rounding); bf16_8bit (bf16 master, 8-bit moments); bf16_nearest (torchao's "
        "numerics). Fewer bytes make the host step faster; the bf16-master ones need "
        "--dtype bf16",
    )
    p.add_argument(
        "--no_fuse_gelu",
        dest="fuse_gelu",
        action="store_false",
        help="trace GPT-2's tanh GELU as written, eight element-wise operations "
        "(OffloadConfig(fuse_gelu=False)), instead of as one aten.gelu(approximate='tanh'): "
        "the same formula, which the fused kernel rounds differently",
    )
    p.add_argument(
        "--no_progress", action="store_true", help="no progress bars (for logs and tests)"
    )
    p.add_argument(
        "--save_on_interrupt",
        type=Path,
        default=None,
        metavar="PATH",
        help="on Ctrl-C, finish the step in progress, then save a checkpoint to PATH that "
        "--resume continues exactly (Ctrl-C always stops cleanly, with the summary)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="PATH",
        help="continue the run saved at PATH (same flags): it takes the steps left of "
        "--steps, as the uninterrupted run would have",
    )
    return p, p.parse_args(argv)


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit code :data:`EXIT_USAGE`) before anything slow happens."""
    try:
        get_spec(args.model_type)
    except ValueError as exc:
        parser.error(str(exc))
    for flag in ("batch_size", "seq_len", "steps", "accumulation_steps"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} is {getattr(args, flag)}; it must be a positive integer")
    if not args.memory_budget > 0:
        parser.error(f"--memory_budget is {args.memory_budget:g}; give a positive number of GB")
    if args.resume is not None and not args.resume.exists():
        parser.error(f"--resume {args.resume}: no such checkpoint file (or directory)")
    if args.host_state in BF16_MASTER_STATES and args.dtype != "bf16":
        parser.error(f"--host_state {args.host_state} keeps a bf16 master: add --dtype bf16")
    if args.plan_only and (args.resume or args.save_on_interrupt):
        parser.error("--resume and --save_on_interrupt train; they do not go with --plan_only")


def offload_config(args: argparse.Namespace) -> OffloadConfig:
    """The user's choices the flags make: what changes the numbers trained, and the run's
    shape. The planner decides the rest."""
    return OffloadConfig(
        dtype=DTYPES[args.dtype],
        host_state=args.host_state,
        accumulation_steps=args.accumulation_steps,
        fuse_gelu=args.fuse_gelu,
    )


@dataclass(frozen=True)
class Target:
    """What a run plans for: the training device, and the hardware profile to plan with
    (None: measured on the device, cached)."""

    device: torch.device
    hardware: HardwareProfile | None

    @property
    def here(self) -> bool:
        """Whether the device is on this machine (its memory can be allocated)."""
        return self.device.type == "cpu" or torch.cuda.is_available()


def training_target(device: str) -> Target:
    """``--device`` resolved on this machine: the current CUDA device, measured, unless
    ``cpu`` is asked for or there is no CUDA; a CPU run plans for
    ``offload_solver.default_hardware()`` (the CPU has no GPU profile to measure)."""
    if device != "cpu" and torch.cuda.is_available():
        return Target(torch.device("cuda", torch.cuda.current_device()), None)
    return Target(torch.device("cpu"), default_hardware())


def draw_batches(
    args: argparse.Namespace, model_type: str, batch_size: int, target: Target
) -> list[dict[str, torch.Tensor]]:
    """One batch per micro-batch, drawn once, on the training device: a run keeps them
    there, and the planner counts them among the device bytes in use. (Where the device
    is not here, on the meta device.)"""
    device = target.device if target.here else torch.device("meta")
    vocab = get_spec(model_type).vocab_size
    return [
        random_batch(batch_size, args.seq_len, device=device, vocab_size=vocab)
        for _ in range(args.accumulation_steps)
    ]


def run_name(model_type: str, batch_size: int, solver_type: str) -> str:
    """The reference's log-file stem; the plan files share it."""
    return f"{model_type}_bs_{batch_size}_st_{solver_type}"


@contextmanager
def phase(desc: str, show: bool) -> Iterator[None]:
    """A progress bar over one blocking phase, on stderr.

    The bar is closed, with its newline, before the caller prints again, so that in a log
    that combines stdout and stderr (run.sh's) every result line starts a line of its own.
    """
    with tqdm(total=1, desc=desc, unit="phase", disable=not show, file=sys.stderr) as bar:
        yield
        bar.update()


def infeasible_message(exc: InfeasibleBudgetError, budget_gb: float, what: str) -> str:
    least_gb = exc.least_budget_bytes / GB
    # Round up to 3 significant digits so that the suggested flag value is itself feasible.
    digits = 2 - math.floor(math.log10(least_gb))
    suggest = math.ceil(least_gb * 10**digits) / 10**digits
    return (
        f"error: memory budget {budget_gb:g} GB is below the least feasible budget "
        f"{least_gb:.6g} GB ({exc.least_budget_bytes} bytes) for {what}; rerun with "
        f"--memory_budget {suggest:g} or more (or a smaller --batch_size)"
    )


def write_plan_files(plan: Plan, log_dir: Path, stem: str, title: str) -> tuple[Path, Path]:
    """The plan JSON and its picture, beside the run's log."""
    log_dir.mkdir(parents=True, exist_ok=True)
    json_path = log_dir / f"{stem}.plan.json"
    write_atomic(json_path, plan.to_json())
    png_path = save_plan_png(plan, log_dir / f"{stem}.plan.png", title=title)
    print(f"plan written to {json_path} and {png_path}", flush=True)
    return json_path, png_path


def build(
    args: argparse.Namespace, model_type: str, device: torch.device | str, show: bool
) -> torch.nn.Module:
    """The model in the training dtype, in training mode: on the CPU (building the module
    copies the weights into fp32 masters where the plan places them), or on meta."""
    t0 = time.perf_counter()
    where = " on meta" if str(device) == "meta" else ""
    with phase(f"build {model_type}{where}", show):
        model = build_model(
            model_type,
            device="cpu" if str(device) != "meta" else "meta",
            dtype=DTYPES[args.dtype],
            seq_len=args.seq_len,
            dropout=args.dropout,
            seed=args.seed,
            # The GPU draws random weights far faster.
            init_device=device if torch.device(device).type == "cuda" else None,
        )
    model.train()
    print(
        f"init_param_size={parameter_bytes(model) / MB:.3f} MB | "
        f"init_model_time={time.perf_counter() - t0:.3f} s",
        flush=True,
    )
    return model


def planned(
    args: argparse.Namespace,
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    target: Target,
    show: bool,
    what: str,
) -> tuple[Plan, OffloadModule | None] | None:
    """Plan (``--plan_only``: ``offload_runtime.plan``) or plan and build
    (``offload_runtime.memory_optimize``), with the same arguments, and print what the
    plan chose; None (the error printed) where the budget is below the least feasible."""
    if show:
        print(
            f"planning: {args.solver_type} solver, budget {args.memory_budget:g} GB",
            file=sys.stderr,
        )
    budget = int(args.memory_budget * GB)
    config = offload_config(args)
    t0 = time.perf_counter()
    try:
        # One set of arguments for both, so that the plan printed is the plan trained.
        call = (model, inputs, budget, args.solver_type)
        options: dict[str, Any] = {
            "config": config,
            "hardware": target.hardware,
            "device": target.device,
            "progress": show,
        }
        module = None if args.plan_only else memory_optimize(*call, **options)
        found = plan(*call, **options) if module is None else module.plan
    except InfeasibleBudgetError as exc:
        print(infeasible_message(exc, args.memory_budget, what), file=sys.stderr)
        return None
    solver_time = time.perf_counter() - t0
    if module is None or not show:  # memory_optimize prints it with progress on
        print(summary_line(found, config.dtype), flush=True)
    print(describe_plan(found), flush=True)
    print(f"solver_time={solver_time:.3f} s", flush=True)
    return found, module


def main(argv: Sequence[str] | None = None) -> int:
    """The example's command line (see the module docstring); its exit status. A Ctrl-C
    before training (while planning, say) ends it with one line instead of a traceback;
    in training, the step in progress completes first (``--save_on_interrupt``)."""
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("\ninterrupted; nothing was saved", file=sys.stderr)
        return EXIT_INTERRUPTED


def start_ranks(device: str) -> tuple[int, int]:
    """(rank, world size): a process group over the ranks ``torchrun`` started (its
    ``WORLD_SIZE`` above 1), with this rank's GPU current; (0, 1) otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    gpus = device != "cpu" and torch.cuda.is_available()
    if gpus:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if gpus else "gloo")
    return dist.get_rank(), world


def run(argv: Sequence[str] | None = None) -> int:
    parser, args = parse_args(argv)
    check_args(parser, args)  # exits with EXIT_USAGE
    torch.manual_seed(args.seed)
    if args.plan_only:
        return plan_only(args)
    rank, world = start_ranks(args.device)
    try:
        return train_run(args, rank, world)
    finally:
        if world > 1:
            dist.destroy_process_group()


def train_run(args: argparse.Namespace, rank: int, world: int) -> int:
    """Build, plan and train (``run`` after the arguments; see the module docstring)."""

    # ---- pick the device
    has_cuda = torch.cuda.is_available()
    if args.device == "cuda" and not has_cuda:
        print(
            "error: --device cuda was requested but CUDA is not available here "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use "
            "--device cpu, --device auto (CPU fallback) or --plan_only",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    model_type, batch_size = args.model_type, args.batch_size
    if args.device == "auto" and not has_cuda:
        model_type, batch_size = CPU_FALLBACK_MODEL, min(batch_size, CPU_FALLBACK_BATCH)
        print(
            f"no CUDA device: falling back to {model_type} at batch {batch_size} on the CPU "
            f"(asked for {args.model_type} at batch {args.batch_size}; use --device cpu to "
            f"train that on the CPU, or --plan_only to plan it)",
            flush=True,
        )
    target = training_target(args.device)
    show = not args.no_progress
    # The module planned returns the loss, so the plan prices the loss's memory too.
    model = WithLMLoss(build(args, model_type, target.device, show))
    torch.manual_seed(args.seed + rank)  # each rank trains on batches of its own
    batches = draw_batches(args, model_type, batch_size, target)

    # ---- trace, profile the hardware, solve, build the offloaded module; the planner
    # reports each of these phases itself when progress is on
    what = f"{model_type} at batch {batch_size}, seq {args.seq_len}, {args.dtype}"
    found = planned(args, model, batches[0], target, show, what)
    if found is None:
        return EXIT_FAILURE
    del model  # the module's storage now holds the weights; free the model's copy
    module = found[1]
    assert module is not None
    optimizer = AMPOptimizer(
        HybridAdam(module.parameters(), lr=args.lr), module, keep_reports=HOST_CHECK_STEPS
    )
    stem = run_name(args.model_type, args.batch_size, args.solver_type)
    title = f"{model_type} bs {batch_size} seq {args.seq_len} {args.dtype}"
    if module.sharding is not None:
        print(module.sharding.describe(), flush=True)
    if rank == 0:
        write_plan_files(module.plan, Path(args.log_dir), stem, title)
    module.train()
    if target.device.type == "cuda":
        # Tracing and hardware profiling used device memory too; the budget is about training.
        torch.cuda.synchronize(target.device)
        torch.cuda.reset_peak_memory_stats(target.device)

    # ---- the training loop: Ctrl-C stops it between steps
    done = 0
    if args.resume is not None:
        try:
            done = load_checkpoint(args.resume, optimizer)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        print(f"resumed from {args.resume} after {done} of {args.steps} steps", flush=True)
    with StopOnInterrupt() as stop:
        step_times, loss = train(
            module, optimizer, batches, args.steps - done, target.device, show, stop
        )
    done += len(step_times)
    if step_times:
        report_run(args, module, optimizer, step_times, loss, target.device)
    if not stop.agreed():  # a Ctrl-C in the last step is every rank's too
        return 0
    print(f"interrupted after {done} of {args.steps} steps", flush=True)
    if args.save_on_interrupt is not None:
        save_checkpoint(args.save_on_interrupt, optimizer, done)
        print(
            f"checkpoint saved to {args.save_on_interrupt}; continue with --resume "
            f"{args.save_on_interrupt}",
            flush=True,
        )
    return EXIT_INTERRUPTED


def train(
    module: OffloadModule,
    optimizer: AMPOptimizer,
    batches: list[dict[str, torch.Tensor]],
    steps: int,
    device: torch.device,
    show: bool,
    stop: StopOnInterrupt | None = None,
) -> tuple[list[float], float]:
    """``steps`` optimizer steps over ``batches`` (one micro-batch each), fewer where
    ``stop`` is requested (checked after each step): each step's time, end to end, and the
    last step's loss (the mean over its micro-batches; nan without a step)."""
    step_times: list[float] = []
    loss = torch.tensor(math.nan)
    bar = tqdm(range(steps), desc="train", unit="step", disable=not show, file=sys.stderr)
    for _ in bar:
        if stop is not None and stop.agreed():
            break
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a sync point: the timer starts on an idle device
        t0 = time.perf_counter()
        optimizer.zero_grad()
        micro_losses = []
        for batch in batches:
            micro = module(**batch)  # WithLMLoss: the loss on the batch's own tokens
            # The step's gradient is the mean over its micro-batches.
            optimizer.backward(micro if len(batches) == 1 else micro / len(batches))
            micro_losses.append(micro.detach())
        optimizer.step()
        loss = micro_losses[0] if len(batches) == 1 else torch.stack(micro_losses).mean()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a sync point: wait for the step's last kernels
        step_times.append(time.perf_counter() - t0)
        # .item() is another sync point, outside the timed region.
        bar.set_postfix(loss=f"{loss.item():.4f}", step_ms=f"{step_times[-1] * 1e3:.1f}")
    bar.close()
    return step_times, float(loss.item())


def report_run(
    args: argparse.Namespace,
    module: OffloadModule,
    optimizer: AMPOptimizer,
    step_times: list[float],
    loss: float,
    device: torch.device,
) -> None:
    """The run's result lines: the reference's, the predictions beside the measurements,
    and what the loop read of the host against the plan."""
    plan = module.plan
    fastest = sorted(step_times)[:FASTEST_STEPS]
    exec_time = sum(fastest) / len(fastest)
    on_cuda = device.type == "cuda"
    if on_cuda:
        peak_alc = torch.cuda.max_memory_allocated(device) / MB
        peak_res = torch.cuda.max_memory_reserved(device) / MB
    else:
        peak_alc = peak_res = 0.0
    assert module.profile is not None
    param_size = module.profile.total_param_bytes / MB
    print(f"final_loss={loss:.6f}", flush=True)
    report = optimizer.last_step
    if plan.options.speculative and report is not None:
        print(
            f"speculation: {report.speculated_regions} regions stepped under the last "
            f"backward; {optimizer.undone_steps} steps undone (fp16 overflow)",
            flush=True,
        )
    print(
        f"| exec_time={exec_time:.5f} s | param_size={param_size:.3f} MB | "
        f"runtime_peak_mem_alc={peak_alc:.3f} MB| runtime_peak_mem_res={peak_res:.3f} MB|",
        flush=True,
    )
    print(
        f"predicted_peak_mem={plan.predicted_peak_bytes / MB:.3f} MB | "
        f"runtime_peak_mem_alc={peak_alc:.3f} MB | "
        f"predicted_step_time={plan.predicted_step_time_s:.5f} s | exec_time={exec_time:.5f} s",
        flush=True,
    )
    if not on_cuda:
        print(
            "note: runtime_peak_mem_* are 0 on the CPU (there is no CUDA allocator to ask), "
            "and the predicted step time is for the planning hardware, not this CPU",
            flush=True,
        )
    last = max(1, min(HOST_CHECK_STEPS, args.steps - 1))
    check = check_host_rate(optimizer, last=last)
    if check is not None:
        # What the host's busy time in the loop says its Adam rate was, against the plan's.
        print(
            f"host_adam: planned {check.planned_params_per_s / 1e9:.4g} G parameters/s, "
            f"{check.planned_busy_s * 1e3:.4g} ms busy per step | in the loop "
            f"{check.measured_busy_s * 1e3:.4g} ms busy per step ({check.steps} steps): "
            f"{check.loop_params_per_s / 1e9:.4g} G parameters/s",
            flush=True,
        )
    backward = check_backward_issue(optimizer, last=last)
    if backward is not None:
        # The host's time in backward(loss) against issuing the plan's operations.
        print(
            f"backward: planned issue factor {backward.planned_factor:.3f} | in the loop "
            f"{backward.measured_s * 1e3:.3f} ms per backward ({backward.steps} steps) for "
            f"{backward.operations} operations at {backward.op_overhead_s * 1e6:.3f} us: "
            f"factor {backward.loop_factor:.3f}",
            flush=True,
        )


def plan_only(args: argparse.Namespace) -> int:
    """Trace on meta, solve as a training run with the same flags would on this machine
    (for the default GPU where a GPU is asked for and there is none), write the files."""
    if args.device == "cpu" or torch.cuda.is_available():
        target = training_target(args.device)
    else:
        target = Target(torch.device("cuda"), default_hardware())
        print(f"no CUDA device: planning for {default_hardware().name}", flush=True)
    show = not args.no_progress
    model = WithLMLoss(build(args, args.model_type, "meta", show))
    # The batches a run keeps on the device, there too: the planner counts them in use.
    batches = draw_batches(args, args.model_type, args.batch_size, target)
    what = f"{args.model_type} at batch {args.batch_size}, seq {args.seq_len}, {args.dtype}"
    found = planned(args, model, batches[0], target, show, what)
    if found is None:
        return EXIT_FAILURE
    plan = found[0]
    stem = run_name(args.model_type, args.batch_size, args.solver_type)
    title = f"{args.model_type} bs {args.batch_size} seq {args.seq_len} {args.dtype}"
    write_plan_files(plan, Path(args.log_dir), stem, title)
    print(
        f"predicted_peak_mem={plan.predicted_peak_bytes / MB:.3f} MB | "
        f"predicted_step_time={plan.predicted_step_time_s:.5f} s | "
        f"hardware={plan.hardware_name}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
