"""Benchmark offloaded training against full-GPU training and the CPU-offload peers.

Run on a CUDA machine with the packages' ``src`` folders on ``PYTHONPATH`` (each row is
measured in its own subprocess, so one that fails - host out of memory, say - is a failed
row rather than the end of the run):

    python benchmarks/offload_bench.py --out bench_out                # the report's rows
    python benchmarks/offload_bench.py --workloads W3 --kinds ours,fsdp2 --out bench_out
    python benchmarks/offload_bench.py --summary benchmarks/results/summary.json OUT1 OUT2

Each row is written to ``OUT/<workload>_<kind>.json`` as soon as it is measured (the
run's date, commit, GPU, torch and command beside it), and ``OUT/summary.json`` is
rewritten after each row: one compact record per row (:func:`compact_row`), what
``targets.py`` judges and tabulates. ``--summary FILE FOLDER...`` compiles the rows of
several output folders (several device calls of one run) into one summary file, without
a GPU. A row measured again into the same folder replaces its file.

Workloads (fp16; GPT-2's vocabulary 1024, Llama's 32000; budgets in GiB = 2**30 bytes):
    W1 gpt2_medium 64 x 8    16     W2 gpt2_xl 64 x 8     3
    W3 gpt2_xl     8 x 1024  40     W4 gpt2_6b 4 x 512   24
    W5 llama_3b    2 x 2048  24     (a current architecture: :data:`WORKLOADS`)
    W6a gpt2_xl    8 x 8192  40     W6b llama_3b 1 x 32768 24  (activations)

Kinds: ours in the configurations of :data:`OURS` (``memory_optimize(asyn)`` and
``AMPOptimizer(HybridAdam)``; ``ours`` is the libraries' defaults), and the peers:
``full_gpu_master`` (full-GPU training with fp32 master weights and Adam state, the
precision ours keeps), ``fsdp2`` (FSDP2 with ``CPUOffloadPolicy``, world size 1) and
``torchao`` (torchao's ``CPUOffloadOptimizer`` on a bf16 model), and W6's peers that
checkpoint every block (``ckpt_peers.py``: ``fsdp2_ckpt``, ``fsdp2_ckpt_host``,
``full_gpu_ckpt``). Without ``--kinds`` each
workload runs the report's rows (:data:`REPORT_KINDS`), and without ``--steps`` its
report's step count (:data:`REPORT_STEPS`).

Measurement: ``--warmup`` steps, then ``--steps`` timed steps, each forward, backward and
optimizer step, synchronised and timed end to end. A row's step time is the mean of its 5
fastest timed steps, and its run mean the mean of them all: our host steps run on into
the next forward, so our steps alternate fast and slow and the 5 fastest understate the
time per step over a run; compare by both. fp16 overflow skips, and the step after each,
are not timed (:func:`_timed_steps`). Peak memory is ``torch.cuda.max_memory_allocated``
from the first warm-up step on (the hardware profile's scratch memory is not counted).
Our rows also record the plan's predicted peak and step, and the parts of the issue's
floor (:func:`issue_floor`).

``--pair-full-gpu`` follows each row of ours whose plan keeps every region's optimizer
state on the device (W1) with full-GPU training built in the same process, the two
stepped in turn (:func:`interleaved_steps`): a launch-bound step takes as long as the host
takes to issue it, and that drifts by more than 5% over the minutes between two rows on a
shared machine, where steps taken in turn see the same host. ``--profile-dir`` keeps a
profiler summary and a Chrome trace of 2 steps after each measurement of ours and of full
GPU (``step_trace.py --summarise`` reads the trace). Set BENCH_COMMIT to name the commit
when running from a copy of the tree that is not a git checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_peers import (
    CKPT_PEERS,
    FSDP2_CKPT,
    FSDP2_CKPT_HOST,
    FULL_GPU_CKPT,
    CkptPeer,
    checkpoint_blocks,
)

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30

WORKLOADS: dict[str, tuple[str, int, int, float]] = {
    # name: (model, batch, seq, budget GiB)
    "W1": ("gpt2_medium", 64, 8, 16),
    "W2": ("gpt2_xl", 64, 8, 3),
    "W3": ("gpt2_xl", 8, 1024, 40),
    "W4": ("gpt2_6b", 4, 512, 24),
    "W5": ("llama_3b", 2, 2048, 24),
    "W6a": ("gpt2_xl", 8, 8192, 40),
    "W6b": ("llama_3b", 1, 32768, 24),
}
"""W5 is a current architecture: transformers' Llama (rotary embeddings, grouped-query
attention through SDPA, RMSNorm, SiLU-gated MLP, untied 32000-token head) of 3.0 B
parameters. Its batch is 2 x 2048: the activations Hugging Face's Llama keeps for backward
at 4 x 2048 come to about 30 GiB by the trace (RMSNorm keeps its fp32 input, the MLP four
8192-wide tensors a layer), beyond a 24 GiB budget whatever the plan places where (the
planner's least budget there is 33.2 GiB: it offloads parameters and state, it does not
recompute activations), and with full-GPU training's 56 GiB of weights and fp32 state
beyond an 80 GB card.

W6a and W6b are bound by activations: the activations plain training keeps for
backward exceed the budget whatever the plan places where, so the planner recomputes some
regions' forwards in backward or sends their saved activations to the host
(``RegionPlan.activations``), and the peers checkpoint every block (:mod:`ckpt_peers`)."""


@dataclasses.dataclass(frozen=True)
class OursConfig:
    """One configuration of ours: the user's configuration and the planner's choices it
    forces (``offload_runtime.PlanForce``); all False is ``memory_optimize`` as a user
    calls it. Every field but ``host_state`` changes speed only, not the trained result."""

    fp16_io: bool = False
    """``PlanForce(fp16_io=True)``: gradients and parameters cross PCIe in fp16, widened
    and narrowed inside the single-pass host step (BENCHMARKS.md, Decisions, "fp16 I/O
    host steps")."""
    host_state: str = "fp32"
    """``OffloadConfig(host_state=...)``: a rung of the host-state precision ladder, fewer
    host bytes a parameter; changes numerics, so it is set beside torchao, not against the
    defaults. The bf16-master rungs train in bf16, as torchao does."""
    speculate: bool = False
    """``PlanForce(speculative=True)``: fp16 host steps start under backward and are undone
    exactly on overflow ("Speculative fp16 host steps")."""
    streamed: bool = False
    """``PlanForce(streamed=True)``: the planner may step some host-state regions on the
    device, their state streamed through a ring ("Streamed host state")."""
    device_conversions: bool = False
    """The planner's other fp16 candidate forced: torch's host kernel, dtype conversions
    on the device, host steps after the overflow answer (``PlanForce(host_kernel="torch",
    convert_on_device=True, speculative=False)``; "Dtype conversions on the device")."""
    no_stream: bool = False
    """``PlanForce(streamed=False)``: no region's state streamed through the device."""
    reference: bool = False
    """The reference's behaviour: every region's optimizer state on the host, stepped by
    torch's kernel after backward, converted on the host, nothing streamed
    (``PlanForce(state_on_device=False, overlap=False, ...)``)."""

    def force(self) -> Any:
        """The ``PlanForce`` of this configuration, or None where it forces nothing."""
        from offload_runtime import PlanForce

        if self.reference:
            return PlanForce(
                host_kernel="torch",
                fp16_io=False,
                convert_on_device=False,
                overlap=False,
                state_on_device=False,
                streamed=False,
            )
        fields: dict[str, Any] = {}
        if self.fp16_io:
            fields["fp16_io"] = True
        if self.speculate:
            fields["speculative"] = True
        if self.streamed or self.no_stream:
            fields["streamed"] = not self.no_stream
        if self.device_conversions:
            fields |= {"host_kernel": "torch", "convert_on_device": True, "speculative": False}
        return PlanForce(**fields) if fields else None

    @property
    def speed_only(self) -> bool:
        """Trains as the defaults do (same numerics): one of the configurations that the
        defaults are set against ("ours within 3% of the fastest configuration")."""
        return not (self.host_state != "fp32" or self.reference)

    @property
    def bf16(self) -> bool:
        """Trains in bf16 (the bf16-master rungs); fp16 otherwise."""
        return self.host_state in ("bf16_stochastic", "bf16_8bit", "bf16_nearest")


OURS: dict[str, OursConfig] = {
    "ours": OursConfig(),
    "ours_io_spec1_stream": OursConfig(fp16_io=True, speculate=True, streamed=True),
    "ours_device_conv": OursConfig(device_conversions=True),
    "ours_no_stream": OursConfig(no_stream=True),
    "ours_bf16m": OursConfig(host_state="bf16_moments"),
    "ours_bf16_sr": OursConfig(host_state="bf16_stochastic"),
    "ours_bf16_8bit": OursConfig(host_state="bf16_8bit"),
    "ours_bf16_rn": OursConfig(host_state="bf16_nearest"),
    "ablation": OursConfig(reference=True),
}
"""Our configurations by kind, as data: ``ours`` the libraries' defaults (nothing
passed); ``ours_io_spec1_stream`` and ``ours_device_conv`` the planner's two fp16
candidates, each forced (fp16 I/O with speculative host steps and streaming; torch's kernel
with conversions on the device); ``ours_no_stream`` the defaults without streamed state;
``ours_bf16m``, ``ours_bf16_sr``, ``ours_bf16_8bit`` and ``ours_bf16_rn`` the rungs of the
host-state ladder below fp32 (bf16 moments; bf16 masters with stochastic rounding, with
8-bit moments, and torchao's round-to-nearest numerics), set beside torchao;
``ablation`` the reference's behaviour."""

FULL_GPU = "full_gpu_master"
PEERS = (FULL_GPU, "fsdp2", "torchao", *CKPT_PEERS)
KINDS = (*OURS, *PEERS)
PEER_ACTIVATION = "gelu_pytorch_tanh"
"""The peers' MLP activation for GPT-2: its tanh GELU as one ``aten.gelu``, the operation
that ``memory_optimize`` traces GPT-2's written-out GELU into by default ("Fused tanh
GELU"), so that every kind runs the same operations. Llama's SiLU is one operation
already: its peers keep it (:func:`peer_activation`)."""


def peer_activation(model: str) -> str:
    """The MLP activation the peers build zoo model ``model`` with: GPT-2's
    :data:`PEER_ACTIVATION`, Llama's own."""
    from offload_gpt_example.models import LLAMA_ACTIVATION, LlamaSpec, get_spec

    return LLAMA_ACTIVATION if isinstance(get_spec(model), LlamaSpec) else PEER_ACTIVATION


def workload_batch(workload: str, device: str) -> dict[str, Any]:
    """The workload's random batch on ``device``, in its model's vocabulary."""
    from offload_gpt_example.models import get_spec, random_batch

    name, batch, seq, _ = WORKLOADS[workload]
    return random_batch(batch, seq, device=device, vocab_size=get_spec(name).vocab_size)


_LADDER = ("ours_bf16_rn", "ours_bf16_sr", "ours_bf16_8bit")
"""The host-state ladder's rows set beside torchao at W3 to W5."""
REPORT_KINDS: dict[str, tuple[str, ...]] = {
    "W1": ("ours", FULL_GPU),
    "W2": ("ours", "ours_io_spec1_stream", "ours_device_conv", "ours_no_stream", FULL_GPU, "fsdp2"),
    "W3": (
        "ours",
        "ours_io_spec1_stream",
        "ours_device_conv",
        "ours_no_stream",
        *_LADDER,
        FULL_GPU,
        "fsdp2",
        "torchao",
    ),
    "W4": (
        "ours",
        "ours_device_conv",
        "ours_io_spec1_stream",
        *_LADDER,
        "torchao",
        "fsdp2",
    ),
    "W5": (
        "ours",
        "ours_io_spec1_stream",
        "ours_device_conv",
        "ours_no_stream",
        *_LADDER,
        FULL_GPU,
        "torchao",
        "fsdp2",
    ),
    "W6a": ("ours", FSDP2_CKPT, FSDP2_CKPT_HOST, FULL_GPU_CKPT),
    "W6b": ("ours", FSDP2_CKPT, FSDP2_CKPT_HOST),
}
"""The rows each workload's targets need (``targets.py``), in the order they run: the
defaults, the other configurations the benchmark builds with the same numerics (the
defaults' target is the fastest of them), the rungs of the host-state ladder set beside
torchao (the 8-bit rung has no target: it is reported beside the others), and the peers.
W1's plan keeps every region's
state on the device, where every configuration plans alike. W4 has no full-GPU row: the
fp32 masters, gradients and Adam state of its 6 B parameters alone take about 120 GB.
W5's full-GPU row holds 20 bytes a parameter (fp16 weights and gradients, fp32 masters,
their gradients and two moments: 56 GiB for 3.0 B parameters) and about 15 GiB of
activations: it fits an 80 GB card, not with much to spare. W6's rows are the defaults
and the checkpointing peers; W6b has no full-GPU row (W5's 56 GiB of weights and fp32
state, and 16 times its tokens)."""
REPORT_STEPS = {"W1": 30, "W2": 20, "W3": 10, "W4": 10, "W5": 10, "W6a": 5, "W6b": 5}
"""Timed steps per row: more where steps are short and bound by issuing operations, the
fewest where a step takes seconds (W6)."""

HOST_PROBE_NUMEL = 64 << 20
"""Parameters of this process's fused host Adam read (:func:`reprofile_if_disturbed`)."""
RESULT_TAG = "BENCH_RESULT "
SUMMARY = "summary.json"
MIN_ROW_S = 30
"""Under ``--time-limit-s``, a row starts only with at least this many seconds left."""


# --------------------------------------------------------------------------------------
# Child side: one measurement
# --------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    """Wait for the device (a sync point; nothing to wait for on the CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed_steps(
    step: Callable[[], None],
    warmup: int,
    steps: int,
    device: str = "cuda",
    skipped: Callable[[], bool] | None = None,
    untimed: list[float] | None = None,
    before_timing: Callable[[], None] | None = None,
) -> list[float]:
    """Times (s) of ``steps`` steps after ``warmup``. With ``skipped`` (did the last step
    skip its update, an fp16 overflow?), skipped steps are not timed: they do no optimizer
    work, so they would pass for the fastest. Nor is the step after one (the first timed
    step too, when the last warm-up step skipped): host steps run on into the next step's
    forward, so a step after a skip waits for none and is short for that reason. Their
    times go to ``untimed``; at most ``2 * steps`` more steps are taken to replace them.
    ``before_timing`` runs once, after the warm-up's last sync."""
    after_skip = False
    for _ in range(warmup):
        step()
        if skipped is not None:
            after_skip = skipped()
    _sync(device)
    if before_timing is not None:
        before_timing()
    times: list[float] = []
    for _ in range(3 * steps if skipped is not None else steps):
        t0 = time.perf_counter()
        step()
        _sync(device)  # sync point: the step is timed end to end
        took = time.perf_counter() - t0
        now = skipped is not None and skipped()
        if now or after_skip:
            if untimed is not None:
                untimed.append(took)
            after_skip = now
            continue
        times.append(took)
        if len(times) == steps:
            break
    return times


def fastest5_mean(times: Sequence[float]) -> float:
    """The mean of the 5 fastest of ``times`` (the benchmark's step time)."""
    if not times:
        raise RuntimeError("no step was timed: every step after warm-up skipped its update")
    return statistics.mean(sorted(times)[:5])


def step_times(times: Sequence[float]) -> dict[str, Any]:
    """A row's step times (ms): the mean of the 5 fastest, the run mean, every step."""
    return {
        "step_ms": fastest5_mean(times) * 1e3,
        "step_mean_ms": statistics.mean(times) * 1e3,
        "steps_ms": [t * 1e3 for t in times],
    }


def cpu_span_summary(spans: dict[str, list[float]] | None) -> dict[str, float | int] | None:
    """Median host wall time (ms) of each call of a step (``forward``: the model and the
    loss; ``backward``: ``backward(loss)`` until it returns, its hooks included; ``step``:
    ``step()`` until it returns) over the calls timed, and how many; None when none was
    timed. In a step bound by issuing operations (W2) the backward's span is what the
    simulator's backward stands for (``replay_bench.py`` sets them side by side)."""
    if not spans or not spans.get("backward"):
        return None
    out: dict[str, float | int] = {k: statistics.median(v) * 1e3 for k, v in spans.items() if v}
    out["calls"] = len(spans["backward"])
    return out


def interleaved_steps(
    a: Callable[[], None],
    b: Callable[[], None],
    warmup: int,
    pairs: int,
    sync: Callable[[], None],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], list[float]]:
    """Times (s) of ``pairs`` steps of ``a`` and of ``b``, taken in turn in one process:
    a b, then b a, and so on, each step timed end to end (``sync`` after it), so that both
    see the same host within a step or two. Each runs ``warmup`` times first, in turn."""
    if pairs < 1:
        raise ValueError(f"pairs={pairs} must be >= 1")
    for _ in range(warmup):
        a()
        b()
    sync()
    ta: list[float] = []
    tb: list[float] = []
    for i in range(pairs):
        order = ((a, ta), (b, tb)) if i % 2 == 0 else ((b, tb), (a, ta))
        for fn, times in order:
            t0 = clock()
            fn()
            sync()  # sync point: each step is timed end to end
            times.append(clock() - t0)
    return ta, tb


def pair_summary(ours_s: list[float], peer_s: list[float]) -> dict[str, Any]:
    """What :func:`interleaved_steps` measured: each side's mean of its 5 fastest steps
    (ms), the ratio of those, of the run means, and the median of the per-pair ratios."""
    if len(ours_s) != len(peer_s) or not ours_s:
        raise ValueError(f"need equal, non-empty step lists, got {len(ours_s)} and {len(peer_s)}")
    return {
        "pairs": len(ours_s),
        "ours_step_ms": fastest5_mean(ours_s) * 1e3,
        "peer_step_ms": fastest5_mean(peer_s) * 1e3,
        "ratio": fastest5_mean(ours_s) / fastest5_mean(peer_s),
        "run_ratio": statistics.mean(ours_s) / statistics.mean(peer_s),
        "pair_ratio_median": statistics.median(o / p for o, p in zip(ours_s, peer_s, strict=True)),
    }


def _reset_peak(device: str) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _memory(device: str) -> dict[str, float]:
    """Peak allocated and reserved device memory (GiB) since :func:`_reset_peak`; 0 on the
    CPU, which has no such counters."""
    import torch

    cuda = torch.device(device).type == "cuda"
    return {
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB if cuda else 0.0,
    }


def issue_cost_us(device: str = "cuda") -> float:
    """The per-operation issue cost read now on ``device`` (us): what the hardware profile
    reads and caches (``offload_runtime.hardware.measure_op_overhead_s``). Rows of ours
    record a read before and after their timed steps (``issue_cost_us_reads``), so that a
    launch-bound row's prediction can be replayed at the host's cost of the moment
    (``replay_bench.py --op-overhead-us reads``)."""
    from offload_runtime.hardware import measure_op_overhead_s

    return measure_op_overhead_s(device) * 1e6


PROFILE_HOST_DISTURBED = 1.5
"""How many times slower than this process times torch's fused host Adam step the cached
hardware profile's rate must read for a row of ours to profile the machine again
(:func:`reprofile_if_disturbed`)."""


def reprofile_if_disturbed(
    in_process_gparam: float, profile: Callable[..., Any] | None = None
) -> dict[str, float] | None:
    """Measure the CUDA profile again (overwriting the cache) when the cached one's fused
    host Adam rate is more than :data:`PROFILE_HOST_DISTURBED` times slower than
    ``in_process_gparam`` (the same step as this process timed it, Gparam/s): such a
    profile was read while the host was busy, and every later plan on the machine would
    take it. Returns the rates before and after (Gparam/s) when it did, else None.
    ``profile``: ``offload_runtime.hardware.profile_hardware`` unless given (tests)."""
    if profile is None:
        from offload_runtime.hardware import profile_hardware

        profile = profile_hardware
    cached = profile("cuda", progress=False).host_adam_params_per_s / 1e9
    if not in_process_gparam > PROFILE_HOST_DISTURBED * cached:
        return None
    print(
        f"[bench] the cached profile's host Adam ({cached:.2f} Gparam/s) is over "
        f"{PROFILE_HOST_DISTURBED}x slower than this process's ({in_process_gparam:.2f}): "
        "profiling again",
        file=sys.stderr,
        flush=True,
    )
    again = profile("cuda", force=True, progress=True).host_adam_params_per_s / 1e9
    return {"cached_gparam": cached, "in_process_gparam": in_process_gparam, "now_gparam": again}


def _build_ours(
    model: Any, data: dict[str, Any], budget: int, config: OursConfig, keep_reports: int
) -> tuple[Any, Any]:
    """``memory_optimize`` as a user calls it (``ours``), or the planner with the choices
    ``config`` forces, and ``AMPOptimizer(HybridAdam)`` over the module, which reads the
    rest from it."""
    import torch

    from offload_optim import AMPOptimizer, HybridAdam
    from offload_runtime import OffloadConfig, memory_optimize
    from offload_runtime.planning import build_offload_module, plan_model

    user = None
    if config.host_state != "fp32":
        dtype = torch.bfloat16 if config.bf16 else torch.float16
        user = OffloadConfig(dtype=dtype, host_state=config.host_state)
    force = config.force()
    if force is None:
        module = memory_optimize(model, data, budget, "asyn", config=user, progress=False)
    else:
        planned = plan_model(model, data, budget, "asyn", config=user, progress=False, force=force)
        module = build_offload_module(model, planned)
    opt = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-4), module, keep_reports=keep_reports)
    return module, opt


def planned_host_busy_s(plan: Any) -> float:
    """The host's busy time in ``plan``'s simulated step (seconds): its host steps and
    publishes, beside what a row's loop measured (``host_busy_ms``)."""
    from offload_solver import Stream

    return float(sum(iv.end_s - iv.start_s for iv in plan.timeline if iv.stream is Stream.HOST))


def _plan_record(module: Any, device: str) -> dict[str, Any]:
    """A row's plan: its predictions, and what ``replay_bench.py`` plans it again with (the
    device traced for, the memory the planner found in use beside the plan, the options
    the plan was made with: where dtype conversions run, the speculation and streaming
    inputs, late host work; a fused GELU, the whole profile and the cost model planned
    with)."""
    from offload_runtime.hardware import profile_hardware

    plan = module.plan
    out: dict[str, Any] = {
        "pred_peak_gib": plan.predicted_peak_bytes / GiB,
        "pred_step_ms": plan.predicted_step_time_s * 1e3,
        "pred_host_busy_ms": planned_host_busy_s(plan) * 1e3,
        "solver_s": plan.solve_time_s,
        "device": device,
        "device_bytes_in_use": plan.device_bytes_in_use,
        "convert_on_device": module.convert_on_device,
        "late_host_work": plan.options.late_host_work,
        "fuse_gelu": module.config.fuse_gelu,
        "loss_in_module": True,
        "speculation_thread": plan.options.speculation_thread,
        "plan_options": dataclasses.asdict(plan.options),
    }
    if plan.options.speculative:
        out["speculative_step_cost"] = plan.options.speculative_step_cost
        out["speculative_params"] = plan.options.speculative_params
    if plan.streamed is not None:
        out["plan_streamed"] = dataclasses.asdict(plan.streamed)
    out["cost_model"] = dataclasses.asdict(plan.cost_model)
    hardware = module.hardware or profile_hardware(device, progress=False)
    out["hardware"] = json.loads(hardware.to_json())
    return out


def _floor_record(module: Any, device: str) -> dict[str, Any]:
    """A row's regions by placement, and the parts of its floor (:func:`issue_floor`): the
    bytes a step must move and the parameters the host must step, at the measured
    profile's rates. Offloaded regions come up twice (forward and backward), resident
    host-state regions once after their host step; host-state gradients go down once;
    streamed regions' state goes up and down (``stream_copy_bytes``). The host's parts
    count every host-state parameter, streamed ones too (:func:`host_floor_parts_ms`)."""
    import torch

    from offload_runtime.hardware import profile_hardware
    from offload_runtime.planning import stream_copy_bytes
    from offload_solver import ActivationPlacement, ParamPlacement, StatePlacement

    plan = module.plan
    offloaded = [rp for rp in plan.regions if rp.placement is not ParamPlacement.RESIDENT]
    host = [rp for rp in plan.regions if rp.state is not StatePlacement.DEVICE]
    streamed = {st.index for st in module.storages if st.streamed}
    streamed_params = sum(rp.region.numel for rp in host if rp.region.index in streamed)
    streamed_moments = torch.float32 if module.config.host_state == "fp32" else torch.bfloat16
    up_b, down_b = stream_copy_bytes(streamed_moments, module.plan.options.fp16_io)
    h2d = (
        sum(2 * rp.region.size_bytes for rp in offloaded)
        + sum(rp.region.size_bytes for rp in host if rp.placement is ParamPlacement.RESIDENT)
        + streamed_params * up_b
    )
    d2h = sum(rp.region.size_bytes for rp in host) + streamed_params * down_b
    hw = profile_hardware(device, progress=False)  # the measured profile (cached)
    host_parts = host_floor_parts_ms(
        hw,
        module.config.host_state,
        sum(rp.region.numel for rp in host),
        sum(rp.region.stepped_numel for rp in host),
    )
    return {
        "regions": len(plan.regions),
        "offloaded_regions": len(offloaded),
        "host_state_regions": len(host),
        "streamed_regions": len(streamed),
        # Where the plan does not keep a region's saved activations on the device.
        "recompute_regions": sum(
            rp.activations
            in (ActivationPlacement.RECOMPUTE, ActivationPlacement.RECOMPUTE_WITH_PREVIOUS)
            for rp in plan.regions
        ),
        "recompute_runs": sum(
            rp.activations is ActivationPlacement.RECOMPUTE for rp in plan.regions
        ),
        "host_activation_regions": sum(
            rp.activations is ActivationPlacement.HOST for rp in plan.regions
        ),
        "profile_host_adam_gparam": hw.host_adam_params_per_s / 1e9,
        "profile_host_memory_gbps": hw.host_memory_bytes_per_s / 1e9,
        "floor_parts_ms": {
            "h2d": h2d / hw.h2d_bytes_per_s(GiB) * 1e3,
            "d2h": d2h / hw.d2h_bytes_per_s(GiB) * 1e3,
            **host_parts,
        },
    }


def host_floor_parts_ms(
    hw: Any, host_state: str, host_numel: int, stepped_numel: int
) -> dict[str, float]:
    """The host's parts of a row's floor (ms), for ``host_numel`` host-state parameters
    (``stepped_numel`` of them trainable) on the rung ``host_state`` of
    ``OffloadConfig.host_state``, at the rates of the profile ``hw``:

    - ``host_adam``, on the fp32 rung only: every host-state parameter at torch's fused
      fp32 host Adam rate, the floor of a step whose fp32 optimizer state lives on the
      host, whatever the configuration does with it. A lower rung moves fewer bytes a
      parameter, and its kernels can step faster than torch's fp32 step, so that rate is
      no floor there.
    - ``host_memory``, where the profile knows the host's memory bandwidth: the trainable
      host-state parameters times the bytes one host step moves per parameter on the rung
      (``offload_solver.host_rates.HOST_STATE_BYTES``) over that bandwidth. A streamed
      region's state crosses host memory too, read by its copies up and written by those
      down: as many bytes a parameter as a host step on its rung moves
      (``stream_copy_bytes``).
    """
    from offload_solver.host_rates import HOST_STATE_BYTES

    parts: dict[str, float] = {}
    if host_state == "fp32":
        parts["host_adam"] = host_numel / hw.host_adam_params_per_s * 1e3
    if hw.host_memory_bytes_per_s > 0:
        traffic = stepped_numel * HOST_STATE_BYTES[host_state]
        parts["host_memory"] = hw.host_memory_time_s(traffic) * 1e3
    return parts


def _ours(
    workload: str,
    kind: str,
    warmup: int,
    steps: int,
    profile_dir: Path | None = None,
    pair_full_gpu: bool = False,
    device: str = "cuda",
) -> dict[str, Any]:
    """One row of ours in the configuration ``OURS[kind]`` (``device`` "cpu": tests)."""
    import torch

    from offload_gpt_example.models import WithLMLoss, build_model
    from offload_runtime.hardware import measure_host_adam_params_per_s

    config = OURS[kind]
    name, _, seq, budget_gib = WORKLOADS[workload]
    budget = int(budget_gib * GiB)
    cuda = torch.device(device).type == "cuda"
    data = workload_batch(workload, device)
    t0 = time.perf_counter()
    reprofiled = None
    if cuda:
        # A cached profile whose host Adam reads far slower than this process times the
        # same step was measured while the host was busy: measured again before planning.
        fused = measure_host_adam_params_per_s(HOST_PROBE_NUMEL) / 1e9
        reprofiled = reprofile_if_disturbed(fused)
    # Weights drawn on the GPU (fast) and kept on the host: the module places them.
    dtype = torch.bfloat16 if config.bf16 else torch.float16
    model = build_model(
        name, device="cpu", dtype=dtype, seq_len=seq, init_device=device if cuda else None
    )
    reports = warmup + 3 * steps  # every step _timed_steps may take
    # The loss inside the module planned, so that the plan prices its memory as well.
    module, opt = _build_ours(WithLMLoss(model), data, budget, config, reports)
    del model
    setup_s = time.perf_counter() - t0

    spans: dict[str, list[float]] | None = None  # collected once the timed steps begin

    def step() -> None:
        t_fwd = time.perf_counter()
        loss = module(**data)
        t_bwd = time.perf_counter()
        opt.backward(loss)
        t_step = time.perf_counter()
        opt.step()
        t_end = time.perf_counter()
        opt.zero_grad()
        if spans is not None:
            spans["forward"].append(t_bwd - t_fwd)
            spans["backward"].append(t_step - t_bwd)
            spans["step"].append(t_end - t_step)

    counted = [opt.step_count]

    def last_skipped() -> bool:
        # step_count is settled when step() returns; reading opt.last_step instead would
        # wait for the host steps still queued and take them out of the timed steps.
        skipped, counted[0] = opt.step_count == counted[0], opt.step_count
        return bool(skipped)

    def before_timing() -> None:
        nonlocal spans
        spans = {"forward": [], "backward": [], "step": []}

    issue_before = issue_cost_us(device)
    _reset_peak(device)
    waited_before = module.controller.update_wait_s
    skipped_s: list[float] = []
    times = _timed_steps(step, warmup, steps, device, last_skipped, skipped_s, before_timing)
    out: dict[str, Any] = {**step_times(times), **_memory(device)}
    out |= {
        "config": dataclasses.asdict(config),
        "budget_gib": budget_gib,
        "setup_s": setup_s,
        "timed_steps": len(times),
        "skipped_steps_ms": [t * 1e3 for t in skipped_s],
        "cpu_span_ms": cpu_span_summary(spans),
        "issue_cost_us_reads": [issue_before, issue_cost_us(device)],
    }
    # Host steps run on past step() into the next forward; what that forward waited for
    # them is the part of the host step that nothing hid.
    waited = module.controller.update_wait_s - waited_before
    out["forward_waited_for_host_ms_per_step"] = (
        waited / (warmup + len(times) + len(skipped_s)) * 1e3
    )
    timed = opt.recent_steps()[-len(times) - len(skipped_s) :]
    busy = [r.host_step_s for r in timed if not r.skipped and r.region_steps]
    if busy:
        # The host worker's summed region steps per step (median over the timed steps).
        out["host_busy_ms"] = statistics.median(busy) * 1e3
    if module.plan.options.speculative:
        out["undone_steps"] = opt.undone_steps
    if reprofiled is not None:
        out["reprofiled"] = reprofiled
    out |= _plan_record(module, device)
    out |= _floor_record(module, device)

    if pair_full_gpu and out["host_state_regions"]:
        # Host steps run on past step() into the next step, which would be the peer's.
        out["paired_full_gpu"] = {"error": "the plan has host-state regions"}
    elif pair_full_gpu:
        # After the row's own measurement (its peak is its own): full-GPU training built
        # beside it and the two stepped in turn.
        full = _full_gpu_steps(workload, device)
        ours_s, full_s = interleaved_steps(step, full.step, warmup, steps, lambda: _sync(device))
        out["paired_full_gpu"] = pair_summary(ours_s, full_s)
        del full
        gc.collect()
    if profile_dir is not None:
        # Then the host steps still queued: the forward waiting on the step before's host
        # steps is in the window, and so are the host worker's region steps.
        _profile_steps(out, step, profile_dir / f"{workload}_{kind}", after=opt.synchronize)
    module.close()
    return out


def _profile_steps(
    out: dict[str, Any],
    step: Callable[[], None],
    stem: Path,
    after: Callable[[], None] | None = None,
    count: int = 2,
) -> None:
    """Profile ``count`` calls of ``step``, then ``after()`` if given, on every thread,
    after the row's measurement: ``profile_<stem>.txt`` (the top operators) and
    ``trace_<stem>.json.gz`` (``step_trace.py --summarise`` reads it); ``out`` gets
    ``profile_streams`` (:func:`step_trace.summarise_trace`) or ``profile_error``. The
    measurement is printed first, so that a profile running past the row's timeout loses
    nothing (the parent keeps the last result line); a failing profile is reported, not
    fatal."""
    import torch
    from step_trace import all_threads_config, load_trace, summarise_trace
    from torch.profiler import ProfilerActivity, profile

    print(RESULT_TAG + json.dumps({**out, "ok": True, "profile_error": "not finished"}), flush=True)
    try:
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            experimental_config=all_threads_config(),
        ) as prof:
            for _ in range(count):
                step()
            if after is not None:
                after()
            torch.cuda.synchronize()
        stem.parent.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        (stem.parent / f"profile_{stem.name}.txt").write_text(table)
        trace = stem.parent / f"trace_{stem.name}.json.gz"
        prof.export_chrome_trace(str(trace))  # a ".gz" path: torch writes it gzipped
        out["profile_streams"] = summarise_trace(load_trace(trace))
    except Exception as exc:  # keep the measurement, say what broke
        out["profile_error"] = f"{type(exc).__name__}: {exc}"


class FullGpuSteps(NamedTuple):
    """Full-GPU training's step functions (:func:`_full_gpu_steps`)."""

    step: Callable[[], None]
    """A training step: forward, backward, the optimizer through the loss scaler."""
    fwd_bwd: Callable[[], None]
    """Forward and backward alone."""
    zero: Callable[[], None]
    """Drop the gradients."""
    loss: Callable[[], float]
    """The loss at the current weights (no gradients; a host sync)."""
    loss_scale: Callable[[], float]
    """The scaler's loss scale: it halves on each step it skips."""
    parameters: Callable[[], list[Any]]
    """The model's fp16 parameters."""
    optimizer: Any
    """The fused Adam over the fp32 masters (its state, for tests)."""


def _grads(tensors: list[Any]) -> list[Any]:
    """The gradients of ``tensors``, each of which must have one."""
    out = []
    for t in tensors:
        if t.grad is None:
            raise RuntimeError("a parameter has no gradient after backward")
        out.append(t.grad)
    return out


def _full_gpu_steps(
    workload: str, device: str = "cuda", ckpt: CkptPeer | None = None
) -> FullGpuSteps:
    """Full-GPU training of ``workload`` on ``device`` at the precision ours keeps: fp16
    weights with fp32 master copies and fp32 Adam state, all on the device. Forward and
    backward run in fp16 as ours runs them (no autocast casts), the gradients are widened
    into fp32 buffers, fused Adam steps the masters through a ``GradScaler``, and the
    masters are narrowed back into the weights. The loss is scaled (2**16 to start, as
    ours' dynamic loss scale): unscaled fp16 gradients underflow. With fp16 Adam state
    instead, the weights diverge within a few steps ("The full-GPU peer keeps fp32
    masters"). ``ckpt``: a checkpointing peer's blocks and forward (:mod:`ckpt_peers`)."""
    import torch

    from offload_gpt_example.models import build_model, lm_loss

    name, _, seq, _ = WORKLOADS[workload]
    model = build_model(
        name, device=device, dtype=torch.float16, seq_len=seq, activation=peer_activation(name)
    )
    forward_context = contextlib.nullcontext if ckpt is None else ckpt.forward_context()
    if ckpt is not None:
        checkpoint_blocks(model)
    data = workload_batch(workload, device)
    params: list[torch.Tensor] = list(model.parameters())
    masters: list[torch.Tensor] = [torch.nn.Parameter(p.detach().float()) for p in params]
    for m in masters:
        m.grad = torch.zeros_like(m)  # kept: each step's widened gradients
    master_grads = _grads(masters)
    opt = torch.optim.Adam(masters, lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device)

    def fwd_bwd() -> None:
        with forward_context():
            loss = lm_loss(model(**data), data["input_ids"])
        torch.autograd.backward(scaler.scale(loss))

    def zero() -> None:
        for p in params:
            p.grad = None

    def step() -> None:
        fwd_bwd()
        torch._foreach_copy_(master_grads, _grads(params))
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        zero()

    def loss_now() -> float:
        with torch.no_grad():
            return float(lm_loss(model(**data), data["input_ids"]))

    def scale() -> float:
        return float(scaler.get_scale())

    return FullGpuSteps(step, fwd_bwd, zero, loss_now, scale, lambda: list(params), opt)


def _full_gpu(
    workload: str,
    warmup: int,
    steps: int,
    profile_dir: Path | None = None,
    device: str = "cuda",
    kind: str = FULL_GPU,
) -> dict[str, Any]:
    """Full-GPU training's row (:func:`_full_gpu_steps`; ``kind`` ``full_gpu_ckpt``: with
    every block checkpointed): its steps, whether it trained (the loss before the first
    step and after the last, and the scale the scaler ended at), and its forward and
    backward alone after the steps (``fwd_bwd_ms``, the floor's compute part)."""
    full = _full_gpu_steps(workload, device, CKPT_PEERS.get(kind))

    def compute_only() -> None:
        full.fwd_bwd()
        full.zero()

    loss_before = full.loss()
    _reset_peak(device)
    out: dict[str, Any] = step_times(_timed_steps(full.step, warmup, steps, device))
    out.update(_memory(device))
    out["loss_before"] = loss_before
    out["loss_after"] = full.loss()
    out["loss_scale_after"] = full.loss_scale()
    out["fwd_bwd_ms"] = fastest5_mean(_timed_steps(compute_only, warmup, steps, device)) * 1e3
    if profile_dir is not None:
        _profile_steps(out, full.step, profile_dir / f"{workload}_{kind}")
    return out


def fsdp2_step(workload: str, mesh: Any, ckpt: CkptPeer | None = None) -> Callable[[], None]:
    """One training step of FSDP2 over ``mesh`` (a CUDA device mesh of the ranks) with
    every block (GPT-2's ``GPT2Block``, Llama's ``LlamaDecoderLayer``) and the root on
    ``CPUOffloadPolicy`` (parameters, gradients and Adam state on the host, fused Adam
    there), fp16 compute. ``ckpt``: each block checkpointed before it is sharded, the
    forward under the peer's context (:mod:`ckpt_peers`)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from offload_gpt_example.models import build_model, lm_loss

    name, _, seq, _ = WORKLOADS[workload]
    model = build_model(
        name,
        device="cpu",
        dtype=torch.float32,
        seq_len=seq,
        init_device="cuda",
        activation=peer_activation(name),
    )
    forward_context = contextlib.nullcontext if ckpt is None else ckpt.forward_context()
    if ckpt is not None:
        checkpoint_blocks(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.blocks():
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    data = workload_batch(workload, "cuda")

    def step() -> None:
        with forward_context():
            loss = lm_loss(model(**data), data["input_ids"])
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _fsdp2(workload: str, warmup: int, steps: int, ckpt: CkptPeer | None = None) -> dict[str, Any]:
    """:func:`fsdp2_step` at world size 1, timed."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    step = fsdp2_step(workload, init_device_mesh("cuda", (1,)), ckpt)
    _reset_peak("cuda")
    out: dict[str, Any] = step_times(_timed_steps(step, warmup, steps))
    out.update(_memory("cuda"))
    dist.destroy_process_group()
    return out


def _torchao(workload: str, warmup: int, steps: int) -> dict[str, Any]:
    """torchao's ``CPUOffloadOptimizer(AdamW, fused=True)`` over a bf16 model on the GPU."""
    import torch
    from torchao.optim import CPUOffloadOptimizer

    from offload_gpt_example.models import build_model, lm_loss

    name, _, seq, _ = WORKLOADS[workload]
    model = build_model(
        name, device="cuda", dtype=torch.bfloat16, seq_len=seq, activation=peer_activation(name)
    )
    data = workload_batch(workload, "cuda")
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=1e-4)

    def step() -> None:
        torch.autograd.backward(lm_loss(model(**data), data["input_ids"]))
        opt.step()
        opt.zero_grad()

    _reset_peak("cuda")
    out: dict[str, Any] = step_times(_timed_steps(step, warmup, steps))
    out.update(_memory("cuda"))
    return out


def measure(
    workload: str,
    kind: str,
    warmup: int,
    steps: int,
    profile_dir: Path | None = None,
    pair_full_gpu: bool = False,
) -> dict[str, Any]:
    """One row, in this process: ``ok`` and the measurement, or ``ok`` False and the error
    (a failure is a row, never fatal)."""
    try:
        if kind in OURS:
            result = _ours(workload, kind, warmup, steps, profile_dir, pair_full_gpu)
        elif kind == FULL_GPU:
            result = _full_gpu(workload, warmup, steps, profile_dir)
        elif kind == "fsdp2":
            result = _fsdp2(workload, warmup, steps)
        elif kind == "torchao":
            result = _torchao(workload, warmup, steps)
        elif kind in CKPT_PEERS and CKPT_PEERS[kind].fsdp:
            result = _fsdp2(workload, warmup, steps, CKPT_PEERS[kind])
        elif kind in CKPT_PEERS:
            result = _full_gpu(workload, warmup, steps, profile_dir, kind=kind)
        else:
            raise ValueError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
        if kind not in OURS:
            result["activation"] = peer_activation(WORKLOADS[workload][0])
        result["ok"] = True
    except Exception as exc:
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    result |= machine()
    return result


def machine() -> dict[str, str]:
    """The GPU's name and torch's version, as the measuring process sees them (the parent
    leaves CUDA alone: a context of its own would hold device memory beside each row)."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {"gpu": gpu, "torch": torch.__version__}


# --------------------------------------------------------------------------------------
# The floor and the rows' records (no GPU: targets.py reads them)
# --------------------------------------------------------------------------------------


def floor_parts(
    row: dict[str, Any], compute_ms: float | None = None, host_gparam: float | None = None
) -> dict[str, float]:
    """The parts of a row's floor (ms): its ``floor_parts_ms`` (the step's H2D and D2H
    bytes over the profiled copy rates; with fp32 host state, every host-state parameter
    over the profile's fused host Adam rate; where the profile knows the host's memory
    bandwidth, the host steps' memory traffic over it: :func:`host_floor_parts_ms`) and,
    as ``gpu_compute``, ``compute_ms``: full-GPU training's forward and backward of the
    workload, where a full-GPU row ran.

    ``host_gparam``: torch's fused host Adam rate as the run's processes read it
    (Gparam/s; the rows' ``host_fused_gparam``). Where it is faster than the profile's
    reading, the host Adam part is taken at it: a floor is a lower bound, and a profile
    read while the host was busy would set it high. The memory part stays as recorded."""
    parts = {k: float(v) for k, v in (row.get("floor_parts_ms") or {}).items()}
    profile = row.get("profile_host_adam_gparam")
    if host_gparam is not None and profile and host_gparam > float(profile):
        for key in parts:
            if key.startswith("host_adam"):
                parts[key] *= float(profile) / host_gparam
    if compute_ms:
        parts["gpu_compute"] = compute_ms
    return parts


def issue_floor(
    row: dict[str, Any], compute_ms: float | None = None, host_gparam: float | None = None
) -> tuple[float, str] | None:
    """The issue's floor for a row of ours (ms, and the part that sets it): the largest of
    full-GPU training's compute (its forward and backward, ``compute_ms``) and the
    host/PCIe parts (the step's copies up, its copies down, the host Adam step of every
    host-state parameter at the fused fp32 rate where the state is fp32, and the host
    steps' memory traffic on the row's rung over the host's memory bandwidth where
    known), each at the measured rates (:func:`floor_parts`). No step can be faster than
    any of them. None when no part is known or every part is 0 (W1 without a full-GPU
    row: nothing crosses PCIe)."""
    parts = floor_parts(row, compute_ms, host_gparam)
    if not parts:
        return None
    key = max(parts, key=lambda k: parts[k])
    if not parts[key] > 0:
        return None
    return parts[key], key


def trained(row: dict[str, Any]) -> bool | None:
    """Whether a full-GPU row trained: its loss after the timed steps finite and below
    the loss before them (None where the row records neither)."""
    before, after = row.get("loss_before"), row.get("loss_after")
    if before is None or after is None:
        return None
    return math.isfinite(after) and after < before


SUMMARY_KEYS = (
    "step_ms",
    "step_mean_ms",
    "timed_steps",
    "peak_alloc_gib",
    "budget_gib",
    "recompute_regions",
    "host_activation_regions",
    "pred_step_ms",
    "pred_peak_gib",
    "floor_parts_ms",
    "profile_host_adam_gparam",
    "profile_host_memory_gbps",
    "host_fused_gparam",
    "fwd_bwd_ms",
    "loss_before",
    "loss_after",
    "error",
)
"""What a summary row keeps of a row (:func:`compact_row`)."""
PAIR_KEYS = ("pairs", "ratio", "run_ratio", "pair_ratio_median", "error")
META_KEYS = ("date", "commit", "gpu", "torch", "command")


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def compact_row(record: dict[str, Any]) -> dict[str, Any]:
    """A row file's record (``meta``, ``workload``, ``kind``, ``result``) as one summary
    row: the workload, the kind, whether it ran, its step times, peaks and predictions, the
    floor's parts and the peers' compute and loss, the budget, and the run's date, commit,
    GPU, torch and command. No per-step times, no traces, no profile."""
    result = record["result"]
    row: dict[str, Any] = {
        "workload": record["workload"],
        "kind": record["kind"],
        "ok": bool(result.get("ok")),
    }
    row |= {k: _rounded(result[k]) for k in SUMMARY_KEYS if k in result}
    row.setdefault("budget_gib", WORKLOADS[record["workload"]][3])
    pair = result.get("paired_full_gpu")
    if isinstance(pair, dict):
        row["paired_full_gpu"] = {k: _rounded(pair[k]) for k in PAIR_KEYS if k in pair}
    row |= {k: record["meta"].get(k) for k in META_KEYS}
    return row


def row_file(out: Path, workload: str, kind: str) -> Path:
    return out / f"{workload}_{kind}.json"


def row_records(folder: Path) -> list[dict[str, Any]]:
    """The row files' records in ``folder``, in file-name order (other JSON is skipped)."""
    records = []
    for path in sorted(folder.glob("*.json")):
        if path.name == SUMMARY:
            continue
        record = json.loads(path.read_text())
        if isinstance(record, dict) and {"workload", "kind", "result", "meta"} <= record.keys():
            records.append(record)
    return records


def sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` by workload, then kind in the order of :data:`KINDS` (a stable sort)."""
    return sorted(
        rows, key=lambda r: (r["workload"], KINDS.index(r["kind"]) if r["kind"] in KINDS else 99)
    )


def write_summary(path: Path, folders: Sequence[Path]) -> list[dict[str, Any]]:
    """Write the summary of every row file in ``folders`` to ``path``; return its rows."""
    rows = sorted_rows([compact_row(r) for folder in folders for r in row_records(folder)])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return rows


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Summary rows from a summary file or from an output folder's row files."""
    if path.is_dir():
        return sorted_rows([compact_row(r) for r in row_records(path)])
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path} is neither a summary file ({{'rows': [...]}}) nor a folder")
    return list(doc["rows"])


# --------------------------------------------------------------------------------------
# Parent side: every row in its own process
# --------------------------------------------------------------------------------------


def run_child(
    workload: str,
    kind: str,
    steps: int,
    args: argparse.Namespace,
    timeout_s: float,
) -> dict[str, Any]:
    """Measure one row in a subprocess of this script; its result, or why there is none."""
    cmd = [sys.executable, __file__, "--child", kind, "--workloads", workload]
    cmd += ["--steps", str(steps), "--warmup", str(args.warmup)]
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    if args.pair_full_gpu:
        cmd += ["--pair-full-gpu"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        # A result printed before the timeout (the measurement, before its profile) stands.
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        got = [ln for ln in partial.splitlines() if ln.startswith(RESULT_TAG)]
        if not got:
            return {"ok": False, "error": f"timed out after {timeout_s:.0f} s"}
        kept: dict[str, Any] = json.loads(got[-1][len(RESULT_TAG) :])
        kept["timed_out_after_s"] = timeout_s
        kept["wall_s"] = time.perf_counter() - t0
        return kept
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if not lines:
        tail = (proc.stderr or proc.stdout)[-300:].replace("\n", " | ")
        if proc.returncode == -9:
            # SIGKILL with no result: on these machines, the kernel's out-of-memory killer.
            return {"ok": False, "error": f"killed (SIGKILL: host out of memory?): {tail}"}
        return {"ok": False, "error": f"exit {proc.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_TAG) :])
    result["wall_s"] = time.perf_counter() - t0
    if not result.get("ok"):
        sys.stderr.write(proc.stderr[-2000:])
    return result


def run_meta(argv: Sequence[str]) -> dict[str, str]:
    """The run's date, commit (BENCH_COMMIT, else git's) and command; each row adds the
    GPU and torch its process saw (:func:`machine`)."""
    commit = os.environ.get("BENCH_COMMIT") or (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        ).stdout.strip()
        or "unknown"
    )
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "command": " ".join(["python", "benchmarks/offload_bench.py", *argv]),
    }


def _names(
    text: str, known: Sequence[str], what: str, parser: argparse.ArgumentParser
) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        parser.error(f"unknown or no {what} {bad or text!r}; known: {', '.join(known)}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: workloads and kinds as lists of known names."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="with --summary: output folders")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--kinds", default="", help="kinds to run for each workload (default: REPORT_KINDS)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps (default: REPORT_STEPS)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=600, help="the most a row may take")
    parser.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="the most the whole run may take: a row starts only with 30 s left, and its "
        "timeout is what is left",
    )
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="output folder")
    parser.add_argument(
        "--profile-dir", default="", help="keep a profile and trace of 2 steps of each row here"
    )
    parser.add_argument(
        "--pair-full-gpu",
        action="store_true",
        help="step full-GPU training in turn with each row of ours that keeps all state on "
        "the device",
    )
    parser.add_argument(
        "--summary",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the summary of the output folders given to FILE and measure nothing",
    )
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.summary is not None:
        if not args.folders:
            parser.error("--summary FILE needs the output folders to summarise")
        missing = [str(f) for f in args.folders if not f.is_dir()]
        if missing:
            parser.error(f"no such folder: {', '.join(missing)}")
        return args
    if args.folders:
        parser.error("output folders are read only with --summary FILE")
    if args.steps is not None and args.steps < 5:
        parser.error("--steps must be at least 5 (the step time is the mean of the 5 fastest)")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    args.workloads = _names(args.workloads, list(WORKLOADS), "workloads", parser)
    args.kinds = _names(args.kinds, KINDS, "kinds", parser) if args.kinds else None
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summary is not None:
        rows = write_summary(args.summary, args.folders)
        print(f"{args.summary}: {len(rows)} rows")
        return 0
    if args.child:
        steps = args.steps or REPORT_STEPS[args.workloads[0]]
        profile_dir = Path(args.profile_dir) if args.profile_dir else None
        result = measure(
            args.workloads[0], args.child, args.warmup, steps, profile_dir, args.pair_full_gpu
        )
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    meta = run_meta(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for w in args.workloads:
        steps = args.steps or REPORT_STEPS[w]
        for k in args.kinds or REPORT_KINDS[w]:
            timeout = args.timeout_s
            if args.time_limit_s is not None:
                left = args.time_limit_s - (time.perf_counter() - t0)
                if left < MIN_ROW_S:
                    print(f"[bench] {w} {k}: not run, {left:.0f} s left", file=sys.stderr)
                    continue
                timeout = min(timeout, left)
            print(f"[bench] {w} {k} ...", file=sys.stderr, flush=True)
            result = run_child(w, k, steps, args, timeout)
            seen = {key: str(result.get(key, "unknown")) for key in ("gpu", "torch")}
            record = {
                "meta": {**meta, **seen},
                "workload": w,
                "kind": k,
                "steps": steps,
                "result": result,
            }
            row_file(args.out, w, k).write_text(json.dumps(record, indent=1) + "\n")
            write_summary(args.out / SUMMARY, [args.out])
            print(
                f"[bench] {w} {k}: {json.dumps(compact_row(record))}", file=sys.stderr, flush=True
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
