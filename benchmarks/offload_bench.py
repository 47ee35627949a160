"""Benchmark offloaded training against full-GPU training and the CPU-offload peers.

Run on a CUDA machine (each measurement in its own subprocess, so one that fails - host
out of memory, say - is a row in the table rather than the end of the run):

    python benchmarks/offload_bench.py                       # all workloads, all kinds
    python benchmarks/offload_bench.py --workloads W1,W2 --kinds ours,full_gpu_master
    python benchmarks/offload_bench.py --append BENCHMARKS.md --json bench.json

Workloads (fp16, vocab 1024; budgets in GiB = 2**30 bytes):
    W1 gpt2_medium 64 x 8    16     W2 gpt2_xl 64 x 8     3
    W3 gpt2_xl     8 x 1024  40     W4 gpt2_6b 4 x 512   24
Kinds:
    ours        memory_optimize(asyn) + AMPOptimizer(HybridAdam), fp32 state where the plan says
    ours_bf16m  the same with bf16 host Adam moments
    ours_bf16m1 bf16 host moments stepped by HybridAdam(host_kernel="single_pass") (numba)
    ours_bf16   ours training in bf16 (as torchao's row does): no overflow check, so host
                steps run speculatively under backward
    ours_hostconv  ours with dtype conversions forced onto the host
                (memory_optimize(convert_on_device=False); "ours" lets the planner choose)
    ours_spec1  ours_spec with HybridAdam(host_kernel="single_pass") (numba): the speculative
                step writes its undo data in the same pass
    ours_spec   ours with AMPOptimizer(speculate_fp16=True): fp16 host steps speculate under
                backward and are undone exactly on overflow (12 B/param more host memory;
                when host memory holds fewer undo buffers, the module is planned and built
                again with speculative_params= the parameters whose buffers fit)
    ours_io     ours with HybridAdam(host_kernel="single_pass", fp16_io=True): fp16 across
                PCIe, widened and narrowed inside the host step (planned with that
                kernel's measured cost against the fused fp32 step, and no conversion
                passes)
    ours_io_spec1  ours_io that speculates as ours_spec1 does
    ours_io_bf16m  ours_io with bf16 host Adam moments (the W4 target with bf16 moments;
                20 bytes per parameter through host memory instead of 28)
    ours_io_bf16m_spec1  ours_io_bf16m that speculates (8 B/param of undo buffers)
    *_stream    any ours_io kind above with streamed host steps: the planner may mark
                host-state regions that do not speculate STREAMED, whose Adam step runs on
                the GPU while the host steps the others (memory_optimize(streamed=...);
                [Note: streamed steps] in offload_optim/streamed.py). BENCH_STREAM_FRACTION
                overrides the planner: that share of those regions' parameters, every
                other region or so in forward order, is streamed (the plan not told);
                BENCH_STREAM_NOT_FIRST=1 moves the plan's first streamed region's device
                step to the next host-state region, and BENCH_STREAM_MAX=N keeps only the
                plan's first N streamed regions streamed and steps the rest on the host
                (the plan not told either; rows record ``streamed_region_indices`` and
                ``stream_from``)
    ablation    the reference's behaviour: all optimizer state on the host, host step after
                backward (no overlap)
    full_gpu    fp16 weights and fp16 Adam state on the GPU, fused CUDA Adam, the loss
                scaled by torch.amp.GradScaler (speed ceiling; BENCH_FULL_GPU_SCALER=0:
                unscaled, as before session 39); also times forward+backward alone (the
                compute floor)
    full_gpu_amp  full-GPU training by torch's mixed-precision recipe: an fp32 model
                (fp32 masters and Adam state, as ours keeps) under fp16 autocast, loss
                scaled, fused Adam (targets.py judges it in lines of its own)
    full_gpu_master  fp16 weights with fp32 master weights and Adam state on the GPU, as
                ours keeps them: fp16 forward and backward (no autocast casts), gradients
                widened, fused Adam on the masters, loss scaled; the same precision as
                ours with nothing moved (targets.py judges it in lines of its own)
    fsdp2       fully_shard per block + root, CPUOffloadPolicy, fp16 MixedPrecisionPolicy,
                fused Adam on the host, world size 1
    torchao     torchao CPUOffloadOptimizer(AdamW, fused=True) on a bf16 model
Step time is the mean of the 5 fastest of ``--steps`` timed steps after ``--warmup`` steps
(the issue's measure); each step is forward, backward and optimizer step, synchronised.
Tables also show "run:", the mean of every timed step. Our host steps run on into the
next forward, so our steps alternate fast and slow and the 5 fastest understate the time
per step over a run (12% below it for W4 ``ours_io_bf16m`` in session 18, 3-5% for the
peers): compare by both. A launch-bound row (W1: each step issues about 2100
operators and keeps the device busy for a quarter to a third of it) takes as long as the
host takes to issue, which drifts by more than 5% from one minute to the next on a shared
machine: judge it by the median ratio over alternating rounds (``gpu_session.sh w1x``, then
``pair_ratios.py``), and what each row issues by ``issue_compare.py`` on the traces
``--profile-dir`` keeps. ``ours`` and ``full_gpu`` rows record the per-operation issue cost
read just before and just after their timed steps (``issue_cost_us_reads``, us), beside
the profile's cached read that the plan priced with. ``--profile-dir`` profiles 2 steps
after the measurement, or BENCH_PROFILE_STEPS (rows record ``profile_steps``).
fp16 overflow skips and the step after each are not timed. Set BENCH_COMMIT to name
the commit when running from a copy of the tree that is not a git checkout. Set
BENCH_HOST_THREADS to run the ``ours`` kinds with that many intra-op CPU threads (the host
Adam's; default: torch's, one per core): the main thread keeps issuing the next forward
while the host steps run, so one core fewer may step faster. Set BENCH_SWITCH_INTERVAL_S
to run them with that ``sys.setswitchinterval``: the host worker needs the GIL between
its region steps while the main thread issues kernels, and Python hands it over only every
switch interval (default 0.005 s); rows record the interval. Set BENCH_POLISH_ROUNDS to
plan the ``ours`` kinds with that many rounds of the solver's local search (default: the
solver's, 0: the greedy phases' plan); rows record it as ``polish_rounds``. Set
BENCH_LATE_HOST_WORK=0 to plan them without moving host work to later regions
(``memory_optimize(late_host_work=False)``, as plans were made before session 51); rows
record ``late_host_work``. Set
BENCH_ISSUE_THREAD=0 to build the ``ours`` kinds' HybridAdam with ``issue_thread=False``
(streamed regions issued on the host worker, not from a thread of their own, the
default); rows record ``issue_thread``. Set BENCH_PLAN_FROM=FILE (a ``--json`` file of an
earlier run) to plan the ``ours`` kinds exactly as that file's row of the same workload and
kind did: its profile (with the host rate it blended), speculative step cost, device bytes
in use and speculation limit, instead of measuring them again. Rows plan from their own
samples otherwise, and on a shared host those move enough to change the plan (W2 streamed
10 to 15 regions across five rows of one machine, session 27), so two trees or two ways of
running compare only on one plan; rows record ``plan_from`` and ``plan_matches_source``
(the same predicted step and peak as the source row). Set BENCH_SPECULATION_THREAD=1 (or
0) to build the ``ours`` kinds' HybridAdam with ``speculation_thread=True`` (or False;
unset: the optimizer's default, True since session 41): speculative host steps on a
thread of their own. Speculating kinds plan for the same (``memory_optimize(
speculation_thread=)``), or with BENCH_PLAN_FROM for what the source row planned, or as
BENCH_PLAN_SPECULATION_THREAD=1 (or 0) says; rows record ``speculation_thread`` and
``plan_speculation_thread``. An ``ours`` child that samples its host rate measures the
CUDA profile again (and caches it) when the cached one's fused host Adam reads over
PROFILE_HOST_DISTURBED times slower than the child's own timing of that step (a profile
read while the host was busy: sessions 44 and 47); rows record ``reprofiled``. Set
BENCH_STREAM_PACED=1 (or 0) to build it with ``paced_ring=True`` (or False; unset: the
optimizer's default): the issuing thread issues each ring chunk once its slot is free;
rows record ``paced_ring``. Set BENCH_RING_YIELD=1 to build it with ``ring_yields=True``
(each ring chunk's copies up after what the h2d stream had queued); rows record
``ring_yields``. Set BENCH_ISSUER_PUBLISHES=0 (or 1) to build it with
``issuer_publishes=False`` (or True; unset: the optimizer's default, True since session
42): the issuing thread publishes streamed regions as they land; rows record
``issuer_publishes``. Set BENCH_STAGE_AHEAD=1 (or 0) to build it with ``stage_ahead=True``
(or False; unset: the optimizer's default, False): step() stages the streamed regions'
leading chunks' copies up before its answer; rows record ``stage_ahead``. Set
BENCH_STAGE_IN_BACKWARD=0 (or 1) to build it with ``stage_in_backward=False`` (or True;
unset: the optimizer's default, True since session 45) and plan to match
(``streamed_step_costs(stage_in_backward=)``): the backward's first streamed gradient
hook stages the leading chunks' master weights and moments; rows record
``stage_in_backward`` (from session 44 on). Set BENCH_STREAM_SLOTS=N (at least 2; with
staging) to plan and build the ring with N buffer sets, so N chunks of state go up in the
backward (``streamed_step_costs(slots=N)``; unset: ``STREAM_SLOTS``, 3); rows record
``stream_slots``. Set
BENCH_STREAM_UP_FRACTION=F to plan with streamed copies up
at F times the H2D rate (``memory_optimize(stream_up_fraction=F)``), and
BENCH_STREAM_HOST_CHARGE=S to charge the host S of the contention of the streamed regions'
copies (``memory_optimize(stream_host_charge=S)``); unset: memory_optimize's defaults
(``STREAM_UP_FRACTION`` 0.78 and ``STREAM_HOST_CHARGE`` 0.5 from session 31 on; 1 and 1
before), or with BENCH_PLAN_FROM the source row's. BENCH_STREAM_HOST_CHARGE=1
BENCH_STREAM_UP_FRACTION=1 plans as before session 31. Rows record both in ``profile``.
Set BENCH_HOST_MARGIN=M (at least 1) to plan the ``ours`` kinds for a host Adam step M
times slower than the rate measured for them (:func:`bench_host_margin`; with
BENCH_PLAN_FROM, M times slower than the source row's); rows record ``host_margin`` (from
session 46 on). The sampling ``ours`` kinds plan with the median of their own rate
samples alone (``samples``, from session 57 on); BENCH_HOST_RATE=blend takes the
geometric mean of it and the cached profile's fused rate over the kind's cost, as
sessions 21-56 did (:func:`bench_host_rate`); rows record ``host_rate_planned_from``.
Set BENCH_MEASURE_ATTENTION=0 (or 1) to plan the ``ours`` kinds with fused attention at
the matrix products' rate (or measured at the model's own shapes:
``memory_optimize(measure_attention=True)``); unset: ``memory_optimize``'s default (from
session 50 on, measured on the GPU unless a pinned row's profile carries the rates; before,
the matrix products' rate); rows record ``measure_attention`` (whether the plan had
measured rates), and their ``hardware`` the rates. By default (BENCH_FUSE_GELU=1,
from session 37 on) the ``ours`` kinds trace GPT-2's written-out tanh GELU fused into one
``aten.gelu`` (``memory_optimize(fuse_gelu=True)``, its default: fewer operations to
issue and activations to keep), and the peers' models (full GPU, FSDP2, torchao) are
built with transformers' ``gelu_pytorch_tanh``, the same function as one ``aten.gelu``,
so that every kind runs the same operations; BENCH_FUSE_GELU=0 runs every kind with the
GELU as written (as every row before session 37 did). Rows record ``fuse_gelu`` (ours)
or ``activation`` (the peers).
Every kind's row records ``gpu_clocks``: the SM and memory clocks, power, temperature and
NVML's clock event reasons over its timed steps (``gpu_clocks.py``; from session 38 on),
read every 20 ms by a thread of its own (five NVML calls a sample, outside the GIL);
BENCH_GPU_CLOCKS=0 turns it off.
By default (BENCH_STREAM_WRITE=1, from session 38 on) a resident streamed region's device
step writes its parameters on the device (``streamed_step_costs(write_resident=True)``,
[Note: writing resident parameters] in offload_optim/streamed.py); BENCH_STREAM_WRITE=0
brings them down and uploads them again, as before. Rows' ``plan_streamed`` records it
(``resident_down_bytes_per_param``, absent or None: uploaded).
Set BENCH_PAIR_FULL_GPU=1 to follow each ``ours`` row's measurement (where full-GPU
training fits beside it: W1) with full-GPU training built in the same process and the two
stepped in turn, ``--steps`` pairs after ``--warmup`` each (:func:`interleaved_steps`); rows
record ``paired_full_gpu`` (:func:`pair_summary`: both sides' steps and the median ratio of
the pairs), which ``targets.py`` judges W1 by where present. The paired training's recipe is
BENCH_PAIR_RECIPE's (default ``master``, from session 40 on; before, ``fp16``), which
``paired_full_gpu`` records as ``recipe``.
Set BENCH_CALIBRATE=N (not with BENCH_PLAN_FROM) to run each ``ours`` plan with host-state
regions for 2 + N steps first, then plan again with the host Adam rate its last N ran at
(``offload_optim.check_host_rate``) and time that plan; rows record ``calibration`` (both host busy
times and rates, the first plan's prediction and streamed regions) and
``host_rate_planned_from: "calibrated"``; with BENCH_CALIBRATE_RING=1 too, the second plan
also takes the fraction of the H2D rate the ring's copies up ran at in those steps
(``offload_optim.check_stream_rate``; ``calibration.ring_fraction_after``), and with
BENCH_CALIBRATE_BACKWARD=1 the backward issue factor at which issuing the plan's
operations takes the host's time in those steps' ``backward(loss)``
(``offload_optim.check_backward_issue``; ``calibration.backward_factor_after``). Streamed rows
record the ring's copies up in their timed steps as ``ring_up`` (the loop's fraction, the
plan's, GB/s while copying, bytes and ms per step).
Set BENCH_ISSUE_AHEAD=1 to plan the ``ours`` kinds with operations issued ahead of the
device (``memory_optimize(issue_ahead=True)``; =0 or unset: the profile's own, False);
rows record ``issue_ahead`` (from session 39 on).
Set BENCH_BACKWARD_ISSUE_FACTOR=F to plan the ``ours`` kinds with each backward operation
of a step with host-state regions issued at F times the issue cost
(``memory_optimize(backward_issue_factor=F)``; unset: ``BACKWARD_ISSUE_FACTOR``, 4,
from session 57 on (1 before), or with BENCH_PLAN_FROM the source row's); rows record
``backward_issue_factor`` (from session 55 on).
Full-GPU training scales its loss with ``torch.amp.GradScaler`` (from session 39 on; rows
and ``paired_full_gpu`` record ``grad_scaler``): unscaled, its fp16 gradients underflow to
subnormals and zeros, which no user's fp16 training would train on. In one call of
session 39 (W3), scaled it drew 589 W to unscaled 491 W at the same 1980 MHz median SM
clock and stepped 207.0 ms to 205.8 (forward and backward 195.8 ms both): the scale
changes what it trains on, not its time. BENCH_FULL_GPU_SCALER=0 runs it unscaled.
Full-GPU rows record whether they trained (from session 39 on): ``loss_before`` and
``loss_after`` (before the first measured step and after the last), ``loss_scale_after``,
and ``fwd_bwd_first_ms`` (forward and backward at the initial weights, before any step;
``fwd_bwd_ms`` is timed after the steps). With fp16 Adam state the weights diverge within
a few steps (``peer_training.py``, on the CPU; on the H200 in session 40, W1's loss rose
from 7.13 to 21.76 over its steps and W3's went to nan). ``full_gpu_master`` (session 40 on)
keeps fp32 masters and state and trains; the issue's ratios and the floor take it where a
run has it (:data:`REFERENCE_FULL_GPU`).
Set BENCH_BUDGET_GIB to plan the ``ours`` kinds under another budget than the workload's
(GiB; e.g. W3 at 120, where nothing needs to leave the device, to set our runtime's own
kernels beside full-GPU training's); rows record ``budget_gib`` (from session 39 on), and
``targets.py`` leaves rows under another budget out of every target.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import inspect
import itertools
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

from gpu_clocks import ClockSampler

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20

WORKLOADS: dict[str, tuple[str, int, int, int]] = {
    # name: (model, batch, seq, budget GiB)
    "W1": ("gpt2_medium", 64, 8, 16),
    "W2": ("gpt2_xl", 64, 8, 3),
    "W3": ("gpt2_xl", 8, 1024, 40),
    "W4": ("gpt2_6b", 4, 512, 24),
}
OURS_KINDS = (
    "ours",
    "ours_bf16m",
    "ours_bf16m1",
    "ours_bf16",
    "ours_hostconv",
    "ours_spec",
    "ours_spec1",
    "ours_io",
    "ours_io_spec1",
    "ours_io_bf16m",
    "ours_io_bf16m_spec1",
    "ours_io_stream",
    "ours_io_spec1_stream",
    "ours_io_bf16m_stream",
    "ours_io_bf16m_spec1_stream",
    "ablation",
)
"""Kinds measured by :func:`_ours` (memory_optimize + AMPOptimizer, in variants)."""
FULL_GPU_KINDS = {"full_gpu": "fp16", "full_gpu_amp": "amp", "full_gpu_master": "master"}
"""Full-GPU training's kinds, each with its recipe (:func:`_full_gpu_steps`)."""
RECIPES = tuple(FULL_GPU_KINDS.values())
"""Full-GPU training's recipes (:func:`_full_gpu_steps`)."""
KINDS = (*OURS_KINDS, *FULL_GPU_KINDS, "fsdp2", "torchao")
RESULT_TAG = "BENCH_RESULT "


# --------------------------------------------------------------------------------------
# Child side: one measurement
# --------------------------------------------------------------------------------------


def _timed_steps(
    step: Callable[[], None],
    warmup: int,
    steps: int,
    skipped: Callable[[], bool] | None = None,
    untimed: list[float] | None = None,
    before_timing: Callable[[], None] | None = None,
    clocks: dict[str, Any] | None = None,
) -> list[float]:
    """Times of ``steps`` steps after ``warmup``. With ``skipped`` (a callable: did the last
    step skip its update, an fp16 overflow?), skipped steps are not counted: they do no
    optimizer work, so they would pass for the fastest. Nor is the step after one (the
    first timed step too, when the last warm-up step skipped): the host steps of a step
    run on into the next one's forward, so a step after a skip waits for none and is
    short for that reason (W2 ``ours_io_spec1``: 165 ms among 450-525, session 18). Their
    times go to ``untimed``; at most ``2 * steps`` more steps are taken to replace them.
    ``before_timing`` runs once, after the warm-up's last sync, before the first timed
    step. ``clocks``: filled with what the GPU's clocks, power and temperature did over
    the timed steps (:class:`gpu_clocks.ClockSampler`)."""
    import torch

    after_skip = False
    for _ in range(warmup):
        step()
        if skipped is not None:
            after_skip = skipped()
    torch.cuda.synchronize()
    if before_timing is not None:
        before_timing()
    times: list[float] = []
    sample = clocks is not None and os.environ.get("BENCH_GPU_CLOCKS", "1") != "0"
    sampler = ClockSampler(torch.cuda.current_device()) if sample else None
    with sampler if sampler is not None else contextlib.nullcontext():
        _timed_loop(step, steps, skipped, untimed, times, after_skip)
    if sampler is not None and clocks is not None:
        clocks.update(sampler.summary())
    return times


def _timed_loop(
    step: Callable[[], None],
    steps: int,
    skipped: Callable[[], bool] | None,
    untimed: list[float] | None,
    times: list[float],
    after_skip: bool,
) -> None:
    """:func:`_timed_steps`' timed steps, appended to ``times``."""
    import torch

    for _ in range(3 * steps if skipped is not None else steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()  # sync point: the step is timed end to end
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


def _fastest5_mean_s(times: list[float]) -> float:
    if not times:
        raise RuntimeError("no step was timed: every step after warm-up skipped its update")
    return statistics.mean(sorted(times)[:5])


def cpu_span_summary(spans: dict[str, list[float]] | None) -> dict[str, float | int] | None:
    """Median host wall time (ms) of each call of a step (``forward``: the model and the
    loss; ``backward``: ``backward(loss)`` until it returns, its hooks included; ``step``:
    ``step()`` until it returns) over the calls timed, and how many; None when none was
    timed. Skipped steps count too: their calls ran the same forward and backward."""
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
    a b, then b a, and so on, each step timed end to end (``sync`` after it). Two rows
    timed one after the other on a shared host are apart by minutes, over which the
    host's speed per operation drifts by more than a launch-bound row's difference from
    its peer (W1 in session 35: full-GPU training's steps at 28-36 ms in one call and
    36-68 ms in the next); steps taken in turn see the same host within a step or two. Each step
    function runs ``warmup`` times first, in turn too."""
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
    """What :func:`interleaved_steps` measured: each side's steps and the mean of its 5
    fastest (ms), the ratio of those means and of the run means, and the median of the
    per-pair ratios (the pair's two steps ran within a step of each other)."""
    if len(ours_s) != len(peer_s) or not ours_s:
        raise ValueError(f"need equal, non-empty step lists, got {len(ours_s)} and {len(peer_s)}")
    ours_ms = [t * 1e3 for t in ours_s]
    peer_ms = [t * 1e3 for t in peer_s]
    fast_ours, fast_peer = _fastest5_mean_s(ours_ms), _fastest5_mean_s(peer_ms)
    return {
        "pairs": len(ours_ms),
        "ours_steps_ms": ours_ms,
        "peer_steps_ms": peer_ms,
        "ours_step_ms": fast_ours,
        "peer_step_ms": fast_peer,
        "ratio": fast_ours / fast_peer,
        "run_ratio": statistics.mean(ours_ms) / statistics.mean(peer_ms),
        "pair_ratio_median": statistics.median(
            o / p for o, p in zip(ours_ms, peer_ms, strict=True)
        ),
    }


def _save_trace(prof: Any, path: Path) -> dict[str, Any]:
    """Write ``prof``'s Chrome trace to ``path`` (``.gz``: torch gzips it; for Perfetto,
    or ``step_trace.py --summarise``; the host worker's region steps are named in it when
    the profile recorded every thread, ``step_trace.all_threads_config``) and
    return ``step_trace.summarise_trace`` of it: per-stream busy time, copy overlap,
    compute idle."""
    from step_trace import load_trace, summarise_trace

    prof.export_chrome_trace(str(path))
    summary: dict[str, Any] = summarise_trace(load_trace(path))
    return summary


def _host_cycle(reports: list[Any]) -> dict[str, Any]:
    """Where the host worker's time goes from one step to the next, as medians (ms) over
    consecutive pairs of stepped reports (``AMPOptimizer.recent_steps()``, oldest first):

    - ``period``: from one backward's call to the next;
    - ``busy``: the host region steps' summed time of a step;
    - ``idle_inside``: gaps between a step's first host step and its last, split into
      ``idle_inside_until_step`` (gaps that began before ``step()`` returned: waiting for
      gradients to land, or for ``step()`` to take the answer and queue the rest) and
      ``idle_inside_after_step`` (gaps that began after it, between the steps it queued:
      the worker's own overhead between regions);
    - ``idle_after_last``: from a step's last host step to the next backward's call (the
      rest of the next forward: the host has nothing to step);
    - ``idle_before_first``: from then (or from the last host step, if later) to the next
      step's first host step (backward until gradients land, or the answer);
    - ``last_regions``: the region whose host step ended last, per step (forward index).

    Empty when fewer than two stepped reports with host steps follow each other.
    """
    parts: dict[str, list[float]] = {
        k: []
        for k in (
            "period",
            "busy",
            "idle_inside",
            "idle_inside_until_step",
            "idle_inside_after_step",
            "idle_after_last",
            "idle_before_first",
        )
    }
    last_regions: list[int] = []
    for a, b in itertools.pairwise(reports):
        # Streamed regions step on the device: their spans are not the host's time.
        host_a = [t for t in a.region_steps if t.on_host]
        host_b = [t for t in b.region_steps if t.on_host]
        if a.skipped or b.skipped or not host_a or not host_b:
            continue
        if a.backward_start_s is None or b.backward_start_s is None:
            continue
        last = max(host_a, key=lambda t: t.end_s)
        first_b = min(t.start_s for t in host_b)
        busy = a.host_step_s
        parts["period"].append(b.backward_start_s - a.backward_start_s)
        parts["busy"].append(busy)
        ordered = sorted(host_a, key=lambda t: t.start_s)
        until = after = 0.0
        for prev, nxt in itertools.pairwise(ordered):
            gap = max(0.0, nxt.start_s - prev.end_s)
            if a.step_end_s is not None and prev.end_s <= a.step_end_s:
                until += gap
            else:
                after += gap
        parts["idle_inside"].append(until + after)
        parts["idle_inside_until_step"].append(until)
        parts["idle_inside_after_step"].append(after)
        parts["idle_after_last"].append(max(0.0, b.backward_start_s - last.end_s))
        parts["idle_before_first"].append(first_b - max(b.backward_start_s, last.end_s))
        last_regions.append(last.region)
    if not last_regions:
        return {}
    out: dict[str, Any] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in parts.items()}
    out["pairs"] = len(last_regions)
    out["last_regions"] = last_regions
    return out


LONG_KERNEL = 2.0
"""A host Adam kernel is long when its wall time per parameter is over this many times the
median of the row's kernels (:func:`kernel_cpu_summary`)."""


def kernel_cpu_summary(samples: list[Any]) -> dict[str, Any]:
    """The single-pass host Adam kernels of a row's timed steps as the CPU probe saw them
    (``offload_optim.single_pass.KernelCpu``; ``OFFLOAD_HOST_ADAM_CPU_PROBE=1``), split into
    the long ones (wall time per parameter over :data:`LONG_KERNEL` times the median) and
    the rest. Each part: ``count``, ``wall_ms`` (median), and the medians of the cores in
    use over each kernel (CPU seconds over its wall seconds): ``process_cores`` (every
    thread of the process), ``machine_cores`` (the whole machine, from ``/proc/stat``'s 10
    ms ticks; None where unread) and ``other_cores`` (the machine's less the process's).
    Empty where no kernel ran."""
    timed = [k for k in samples if k.wall_s > 0 and k.numel > 0]
    if not timed:
        return {}
    per = statistics.median(k.wall_s / k.numel for k in timed)

    def part(ks: list[Any]) -> dict[str, Any]:
        read = [k for k in ks if k.machine_busy_s is not None]

        def cores(values: list[float]) -> float | None:
            return statistics.median(values) if values else None

        return {
            "count": len(ks),
            "wall_ms": cores([k.wall_s * 1e3 for k in ks]),
            "threads": cores([float(k.threads) for k in ks]),
            "process_cores": cores([k.process_cpu_s / k.wall_s for k in ks]),
            "machine_cores": cores([k.machine_busy_s / k.wall_s for k in read]),
            "other_cores": cores([(k.machine_busy_s - k.process_cpu_s) / k.wall_s for k in read]),
        }

    long = [k for k in timed if k.wall_s / k.numel > LONG_KERNEL * per]
    rest = [k for k in timed if k.wall_s / k.numel <= LONG_KERNEL * per]
    return {"long": part(long), "rest": part(rest)}


def _step_times(times: list[float]) -> dict[str, Any]:
    """Every timed step (ms), their median and their mean, beside the issue's mean of the 5
    fastest. With host steps that run on into the next forward, our steps alternate fast
    and slow, and the 5 fastest leave out the slow ones: the mean of every step is the
    time per step over the run (W4 ``ours_io_bf16m``: 1264 ms by the 5 fastest, 1439 ms
    per step over the run; torchao's steps, which leave nothing running, 1200 and 1244
    ms; session 18)."""
    nan = float("nan")
    return {
        "steps_ms": [t * 1e3 for t in times],
        "step_median_ms": statistics.median(times) * 1e3 if times else nan,
        "step_mean_ms": statistics.mean(times) * 1e3 if times else nan,
    }


def steps_under_floor(
    steps_ms: list[float], floor_parts_ms: dict[str, float], plan_rate_ratio: float = 1.0
) -> int:
    """How many timed steps took less than the plan's own floor: the larger of its H2D
    bytes, its D2H bytes and its host-stepped parameters at the measured rates
    (``host_adam_all_host_state``, the issue's count with streamed regions on the host,
    is left out). Every step has that work to do, so a step under it left part of it to
    the next one: the host worker's steps and their uploads run on past the step's
    device sync. Where steps do this, the mean of the 5 fastest is not a steady rate and
    the run mean is (session 25, call 4's second threaded W2 row: 3 of 20 steps under 229
    ms, 233 ms by the 5 fastest, 380 ms over the run).

    ``plan_rate_ratio`` is the plan's host Adam rate over the profile's fused fp32 one
    (the floor's). Where it is over 1 the plan's host kernel is faster than the fused one
    (fp16 I/O, bf16 moments, or the loop's rate under ``BENCH_CALIBRATE``), and the host
    part is taken at the plan's rate: with the fused rate, session 34's calibrated W4 row
    with bf16 moments counted 5 of 10 steps under a host part of 1028 ms that its host
    did in 907-953 ms a step."""
    parts = [floor_parts_ms[k] for k in ("h2d", "d2h") if k in floor_parts_ms]
    if "host_adam" in floor_parts_ms:
        parts.append(floor_parts_ms["host_adam"] / max(1.0, plan_rate_ratio))
    if not parts:
        return 0
    floor = max(parts)
    return sum(1 for t in steps_ms if t < floor)


def _memory() -> dict[str, float]:
    import torch

    return {
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
    }


ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
"""Caching-allocator counters whose change over the timed steps a row records: a retry
frees cached blocks (``cudaFree``, which waits for the device) and tries again, and a
device allocation or free in steady state means blocks did not come from the cache.
Either would stall the thread that asked for memory."""


def _allocator_counts() -> dict[str, int]:
    import torch

    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_EVENTS}


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a row planned with, read back from its JSON (``BENCH_PLAN_FROM``)."""

    source: str
    hardware_json: str
    """The profile the plan was made with (host Adam rate already blended)."""
    speculative_step_cost: float
    device_bytes_in_use: int | None
    speculative_params: int | None
    speculation_thread: bool
    """Whether the row planned for speculative steps on their own thread (rows before
    session 41 planned for the hooks' way)."""
    pred_step_ms: float
    pred_peak_gib: float
    """The row's predictions: a plan made from the same inputs predicts the same."""
    stage_in_backward: bool = False
    """Whether the row planned its streamed regions' state staged in the backward (its
    ``plan_streamed`` counted staged chunks: rows from session 45's planner on). A row
    pinned to it plans so whatever its own optimizer does (``BENCH_STAGE_IN_BACKWARD``),
    so that both arms of an A/B run one plan."""


@dataclasses.dataclass(frozen=True)
class Calibrated:
    """What a row plans with the second time under ``BENCH_CALIBRATE``: the first plan's
    profile and device memory in use, with the host rate from its own loop."""

    hardware: Any
    """The first plan's ``HardwareProfile`` (its host rate is replaced)."""
    device_bytes_in_use: int | None
    host_params_per_s: float
    """``offload_optim.check_host_rate``'s ``loop_params_per_s``."""
    stream_up_fraction: float | None = None
    """With ``BENCH_CALIBRATE_RING=1``: ``offload_optim.check_stream_rate``'s
    ``loop_fraction`` (else the first plan's)."""
    backward_issue_factor: float | None = None
    """With ``BENCH_CALIBRATE_BACKWARD=1``: ``offload_optim.check_backward_issue``'s
    ``loop_factor`` (else the first plan's)."""


def issue_cost_us(device: str = "cuda") -> float:
    """The per-operation issue cost read now on ``device`` (us): what the hardware profile
    reads three times and caches (``offload_runtime.hardware.measure_op_overhead_s``).
    Rows record a read before and after their timed steps (``issue_cost_us_reads``) so that
    a launch-bound row's prediction can be set beside the host's cost of the moment
    (``replay_bench.py --op-overhead-us reads``): W1's plans price about 2100 operations a
    step with the profile's one cached read."""
    from offload_runtime.hardware import measure_op_overhead_s

    return measure_op_overhead_s(device) * 1e6


def reprofile_if_disturbed(
    in_process_gparam: float,
    profile: Callable[..., Any] | None = None,
) -> dict[str, float] | None:
    """Measure the CUDA profile again (overwriting the cache) when the cached one's fused
    host Adam rate is more than :data:`PROFILE_HOST_DISTURBED` times slower than
    ``in_process_gparam`` (torch's fused step as this process timed it, Gparam/s; see
    :func:`fused_rate_in_process_gparam`). Returns the rates before and after (Gparam/s)
    when it did, else None. ``profile``: ``offload_runtime.hardware.profile_hardware``
    unless given (tests)."""
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


def plan_inputs_from(path: str, workload: str, kind: str) -> PlanInputs:
    """The plan inputs of ``workload``'s ``kind`` row in an ``offload_bench.py --json``
    file, so that a run of another tree (or another way of running the same plan) plans
    exactly as that row did. Raises ValueError when the file lacks the row or the row
    lacks the profile it planned with (rows before session 21 did not keep it)."""
    doc = json.loads(Path(path).read_text())
    row = doc.get("results", {}).get(workload, {}).get(kind)
    if not isinstance(row, dict) or not row.get("ok", False):
        raise ValueError(f"{path} has no measured {workload} {kind} row to plan from")
    if "hardware" not in row:
        raise ValueError(f"{path}'s {workload} {kind} row lacks the profile it planned with")
    in_use = row.get("device_bytes_in_use")
    limit = row.get("speculative_params")
    return PlanInputs(
        source=path,
        hardware_json=json.dumps(row["hardware"]),
        speculative_step_cost=float(row.get("speculative_step_cost", 1.0)),
        device_bytes_in_use=None if in_use is None else int(in_use),
        speculative_params=None if limit is None else int(limit),
        speculation_thread=bool(row.get("plan_speculation_thread", False)),
        pred_step_ms=float(row["pred_step_ms"]),
        pred_peak_gib=float(row["pred_peak_gib"]),
        stage_in_backward=bool((row.get("plan_streamed") or {}).get("staged_chunks", 0)),
    )


def _ours(
    workload: str, kind: str, warmup: int, steps: int, profile_dir: Path | None
) -> dict[str, Any]:
    import torch

    from offload_gpt_example.models import build_model, lm_loss, random_batch
    from offload_optim import (
        AMPOptimizer,
        HybridAdam,
        check_backward_issue,
        check_host_rate,
        check_stream_rate,
        measure_host_step_cost,
        measure_host_step_params_per_s,
        measure_speculative_step_cost,
        planned_host_busy_s,
        stream_copy_bytes,
        streamed_step_costs,
    )
    from offload_runtime import (
        BACKWARD_ISSUE_FACTOR,
        STREAM_HOST_CHARGE,
        STREAM_UP_FRACTION,
        memory_optimize,
    )
    from offload_runtime.hardware import profile_hardware
    from offload_solver import HardwareProfile, ParamPlacement, StatePlacement
    from offload_solver.solve import POLISH_ROUNDS

    name, batch, seq, _ = WORKLOADS[workload]
    budget_gib = bench_budget_gib(workload)
    budget = int(budget_gib * GiB)
    if os.environ.get("BENCH_HOST_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_HOST_THREADS"]))
    if os.environ.get("BENCH_SWITCH_INTERVAL_S"):
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL_S"]))
    dtype = torch.bfloat16 if kind == "ours_bf16" else torch.float16
    model = build_model(name, device="cpu", dtype=dtype, seq_len=seq, init_device="cuda")
    data = random_batch(batch, seq, device="cuda")
    ablation = kind == "ablation"
    stream = kind.endswith("_stream")
    base = kind.removesuffix("_stream")
    speculate = base in ("ours_spec", "ours_spec1", "ours_io_spec1", "ours_io_bf16m_spec1")
    bf16_moments = base in ("ours_bf16m", "ours_bf16m1", "ours_io_bf16m", "ours_io_bf16m_spec1")
    fp16_io = base.startswith("ours_io")
    single = base in ("ours_spec1", "ours_bf16m1") or fp16_io
    polish_rounds = int(os.environ.get("BENCH_POLISH_ROUNDS") or POLISH_ROUNDS)
    late_host_work = bench_late_host_work()
    measure_env = os.environ.get("BENCH_MEASURE_ATTENTION")
    # Unset: memory_optimize's default (None: measured on the GPU, from session 50 on;
    # with BENCH_PLAN_FROM, the source row's rates if it had them).
    measure_attention = None if not measure_env else measure_env != "0"
    ahead_env = os.environ.get("BENCH_ISSUE_AHEAD")
    issue_ahead = None if ahead_env is None else ahead_env != "0"
    factor_env = os.environ.get("BENCH_BACKWARD_ISSUE_FACTOR")
    backward_issue_factor = float(factor_env) if factor_env else None
    fuse_gelu = bench_fuse_gelu()
    pair_full_gpu = os.environ.get("BENCH_PAIR_FULL_GPU", "0") != "0"
    issue_thread = os.environ.get("BENCH_ISSUE_THREAD", "1") != "0"
    speculation_thread = _hybrid_adam_flag("BENCH_SPECULATION_THREAD", "speculation_thread")
    ring_yields = os.environ.get("BENCH_RING_YIELD", "0") != "0"
    issuer_publishes = _hybrid_adam_flag("BENCH_ISSUER_PUBLISHES", "issuer_publishes")
    paced_ring = _hybrid_adam_flag("BENCH_STREAM_PACED", "paced_ring")
    stage_in_backward = _hybrid_adam_flag("BENCH_STAGE_IN_BACKWARD", "stage_in_backward")
    stream_slots = bench_stream_slots()
    stage_ahead = _hybrid_adam_flag("BENCH_STAGE_AHEAD", "stage_ahead")
    # The streamed copies' contention as set; else, below, the pinned row's or
    # memory_optimize's defaults.
    up_env = os.environ.get("BENCH_STREAM_UP_FRACTION")
    stream_up_fraction = float(up_env) if up_env else None
    charge_env = os.environ.get("BENCH_STREAM_HOST_CHARGE")
    stream_host_charge = float(charge_env) if charge_env else None
    forced = os.environ.get("BENCH_STREAM_FRACTION")
    stream_fraction = float(forced) if stream and forced else None
    not_first = stream and stream_fraction is None and bench_stream_not_first()
    stream_max = bench_stream_max() if stream and stream_fraction is None else None
    if not_first and stream_max is not None:
        raise ValueError("BENCH_STREAM_NOT_FIRST and BENCH_STREAM_MAX each edit the plan: one")
    host_kernel = "single_pass" if single else "torch"
    moments = torch.bfloat16 if bf16_moments else torch.float32
    # bf16 moments and the fp16-I/O kernel step at other rates than the fp32 fused Adam
    # the hardware profile times. The plan is told both the kernel's cost relative to
    # that step, measured back to back (memory_optimize(host_step_cost=)), and the
    # median of three samples of its absolute rate (host_step_params_per_s=), and takes
    # the geometric mean of the two rates. Each alone misled some plans on the H200's
    # shared host: the absolute rate read 3.0-5.9 Gparam/s over one machine's children
    # in session 18 (plans 22-50% over); in session 21 the cost read 0.58-0.93 for one
    # kernel and the profile's fused rate 3.4-4.1 Gparam/s (plans -16% to +23%).
    # Replaying ten rows of sessions 19 and 21 with the mean put every step within 11%
    # (replay_bench.py --host-rate blend); the five rows of session 21's call 3, planned
    # with it, came within 2-17%.
    plan_from = os.environ.get("BENCH_PLAN_FROM")
    pinned = plan_inputs_from(plan_from, workload, kind) if plan_from else None
    # Unset with BENCH_PLAN_FROM: the source row's profile already holds the split it
    # planned with and its backward issue factor, which None keeps (rows before d1e1237
    # planned with 1 and 1; before session 57 at a factor of 1). Unset otherwise:
    # memory_optimize's defaults.
    if pinned is None:
        if stream_up_fraction is None:
            stream_up_fraction = STREAM_UP_FRACTION
        if stream_host_charge is None:
            stream_host_charge = STREAM_HOST_CHARGE
        if backward_issue_factor is None:
            backward_issue_factor = BACKWARD_ISSUE_FACTOR
    # A pinned row's profile holds the host rate it blended: nothing is sampled again.
    measured = (bf16_moments or fp16_io) and pinned is None
    rate_samples = (
        [
            measure_host_step_params_per_s(moments, host_kernel=host_kernel, fp16_io=fp16_io)
            for _ in range(3)
        ]
        if measured
        else []
    )
    host_cost = (
        measure_host_step_cost(moments, host_kernel=host_kernel, fp16_io=fp16_io)
        if measured
        else None
    )
    # A cached profile whose fused host Adam rate reads far slower than this process times
    # the same step (its samples times its cost) was measured while the host was busy
    # (sessions 44 and 47: 1.65 and 1.40 Gparam/s against 3.55-5.19 in process); every
    # plan of the machine would take it. Measured again (and cached) before planning.
    reprofiled = (
        reprofile_if_disturbed(statistics.median(rate_samples) * host_cost / 1e9)
        if rate_samples and host_cost is not None
        else None
    )
    # A speculative step also writes its undo data: the planner charges the steps taken
    # under backward this many times a plain one (measured with the kernel that runs them).
    spec_cost = (
        pinned.speculative_step_cost
        if pinned is not None
        else measure_speculative_step_cost(moments, host_kernel=host_kernel, fp16_io=fp16_io)
        if speculate
        else 1.0
    )

    # What the planner models: BENCH_PLAN_SPECULATION_THREAD's way, else a pinned row's
    # (one plan), else the optimizer's.
    plan_env = os.environ.get("BENCH_PLAN_SPECULATION_THREAD")
    if plan_env is not None:
        plan_thread = plan_env != "0"
    elif pinned is not None:
        plan_thread = pinned.speculation_thread
    else:
        plan_thread = speculation_thread
    plan_thread = speculate and plan_thread
    host_margin = bench_host_margin()
    # The kind's own samples alone (the default), or with BENCH_HOST_RATE=blend their
    # geometric mean with the profile's rate over the cost.
    # (Read whether or not this kind samples, so that a misspelt value fails every kind.)
    plan_cost = None if bench_host_rate() == "samples" and rate_samples else host_cost

    def build(
        model: Any, limit: int | None, calibrated: Calibrated | None = None
    ) -> tuple[Any, AMPOptimizer]:
        if calibrated is not None:  # the first plan's inputs, the host rate from its loop
            hardware: HardwareProfile | None = calibrated.hardware
            in_use = calibrated.device_bytes_in_use
        elif pinned is not None:
            hardware = HardwareProfile.from_json(pinned.hardware_json)
            in_use = pinned.device_bytes_in_use
        else:
            hardware, in_use = None, None
        # Slowed by BENCH_HOST_MARGIN where it is set.
        host_inputs = host_margin_inputs(
            None if calibrated is not None else plan_cost,
            calibrated.host_params_per_s
            if calibrated is not None
            else statistics.median(rate_samples)
            if rate_samples
            else None,
            host_margin,
        )
        module = memory_optimize(
            model,
            data,
            budget,
            "asyn",
            dtype=dtype,
            hardware=hardware,
            device_bytes_in_use=in_use,
            progress=False,
            state_on_device=not ablation,
            convert_on_device=False if kind == "ours_hostconv" else None,
            # Speculating fp16 steps run as their gradients land: plan for that.
            host_step_after_backward=False if speculate else None,
            speculative_step_cost=spec_cost,
            speculative_params=limit,
            speculation_thread=plan_thread,
            # Both ways: the planner takes the geometric mean of the two rates.
            host_step_cost=host_inputs[0],
            host_step_params_per_s=host_inputs[1],
            fp16_io=fp16_io,
            # What the optimizer's ring moves and holds, for the planner to weigh (not
            # when BENCH_STREAM_FRACTION forces the choice instead).
            # The ring sized to a tenth of the budget at most (from f68ff1a's successor on;
            # session 22's rows had 16 M-element chunks whatever the budget).
            streamed=(
                streamed_step_costs(
                    moments,
                    fp16_io,
                    budget_bytes=budget,
                    write_resident=bench_stream_write(),
                    stage_in_backward=(
                        stage_in_backward if pinned is None else pinned.stage_in_backward
                    ),
                    slots=stream_slots,
                )
                if stream and stream_fraction is None
                else None
            ),
            polish_rounds=polish_rounds,
            late_host_work=late_host_work,
            stream_up_fraction=(
                calibrated.stream_up_fraction
                if calibrated is not None and calibrated.stream_up_fraction is not None
                else stream_up_fraction
            ),
            stream_host_charge=stream_host_charge,
            measure_attention=measure_attention,
            fuse_gelu=fuse_gelu,
            issue_ahead=issue_ahead,
            backward_issue_factor=(
                calibrated.backward_issue_factor
                if calibrated is not None and calibrated.backward_issue_factor is not None
                else backward_issue_factor
            ),
        )
        if stream_fraction is not None:
            _force_streamed(module, stream_fraction)
        elif not_first:
            _stream_not_first(module.storages)
        elif stream_max is not None:
            _cap_streamed(module.storages, stream_max)
        opt = AMPOptimizer(
            HybridAdam(
                module.parameters(),
                lr=1e-4,
                moments_dtype=moments,
                host_kernel=host_kernel,
                fp16_io=fp16_io,
                issue_thread=issue_thread,
                speculation_thread=speculation_thread,
                paced_ring=paced_ring,
                ring_yields=ring_yields,
                issuer_publishes=issuer_publishes,
                stage_ahead=stage_ahead,
                stage_in_backward=stage_in_backward,
            ),
            module,
            overlap=not ablation,
            speculate_fp16=speculate,
            speculative_params=limit,
            keep_reports=warmup + steps + 2 * steps,  # room for skips and the steps after
        )
        return module, opt

    t0 = time.perf_counter()
    limit: int | None = None if pinned is None else pinned.speculative_params
    module, opt = build(model, limit)
    del model
    if speculate and limit is None:
        # Undo buffers for every host-state parameter may not fit beside the host state
        # (W4 on a 128 GiB host): then plan again for the regions whose buffers fit.
        host_params = sum(
            rp.region.numel for rp in module.plan.regions if rp.state is StatePlacement.HOST
        )
        fit = opt.optimizer.speculative_params_that_fit()
        if fit < host_params:
            limit = fit
            module.close()
            del module, opt
            gc.collect()  # the optimizer's host moments, before the second build allocates
            model = build_model(name, device="cpu", dtype=dtype, seq_len=seq, init_device="cuda")
            module, opt = build(model, limit)
            del model

    # The host's wall time in each call of the timed steps (cpu_span_ms): in a step bound by
    # issuing operations (W2) the backward's span is what the simulator's backward stands
    # for; collected once before_timing has run.
    spans: dict[str, list[float]] | None = None

    def step() -> None:
        t_fwd = time.perf_counter()
        loss = lm_loss(module(**data), data["input_ids"])
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

    # BENCH_CALIBRATE=N: run the plan for 2 + N steps, take the host's busy time per step
    # from the last N (check_host_rate), and plan again with the host rate that makes the
    # simulated host as busy; the row times the second plan.
    calibrate_steps = int(os.environ.get("BENCH_CALIBRATE") or 0)
    calibrate_ring = os.environ.get("BENCH_CALIBRATE_RING") == "1"
    calibrate_backward = os.environ.get("BENCH_CALIBRATE_BACKWARD") == "1"
    calibration: dict[str, Any] | None = None
    if calibrate_steps > 0 and pinned is None:
        for _ in range(2 + calibrate_steps):
            step()
        torch.cuda.synchronize()
        check = check_host_rate(opt, last=calibrate_steps)
        ring_check = check_stream_rate(opt, last=calibrate_steps) if calibrate_ring else None
        bwd_check = check_backward_issue(opt, last=calibrate_steps) if calibrate_backward else None
        if check is not None:
            first_hw = module.hardware
            rate = check.loop_params_per_s
            ring_fraction = None if ring_check is None else ring_check.loop_fraction
            bwd_factor = None if bwd_check is None else bwd_check.loop_factor
            calibration = {
                "steps": check.steps,
                "planned_host_busy_ms": check.planned_busy_s * 1e3,
                "measured_host_busy_ms": check.measured_busy_s * 1e3,
                "rate_before_gparam": check.planned_params_per_s / 1e9,
                "rate_after_gparam": rate / 1e9,
                "pred_step_ms_before": module.plan.predicted_step_time_s * 1e3,
                "streamed_regions_before": sum(1 for st in module.storages if st.streamed),
                "ring_fraction_before": None if first_hw is None else first_hw.stream_up_fraction,
                "ring_fraction_after": ring_fraction,
                "backward_factor_before": (
                    None if first_hw is None else first_hw.backward_issue_factor
                ),
                "backward_factor_after": bwd_factor,
                "backward_ms_measured": (None if bwd_check is None else bwd_check.measured_s * 1e3),
            }
            in_use = module.plan.device_bytes_in_use
            module.close()
            del module, opt
            gc.collect()
            model = build_model(name, device="cpu", dtype=dtype, seq_len=seq, init_device="cuda")
            module, opt = build(
                model, limit, Calibrated(first_hw, in_use, rate, ring_fraction, bwd_factor)
            )
            del model
    setup_s = time.perf_counter() - t0
    issue_before = issue_cost_us()
    # Hardware profiling inside memory_optimize used scratch memory once; the budget is
    # about training, so the peak counts from here (the module's buffers stay counted).
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    counted = [opt.step_count]

    def last_skipped() -> bool:
        # step_count is settled when step() returns; reading opt.last_step instead would
        # wait for the host steps still queued and take them out of the timed steps.
        skipped, counted[0] = opt.step_count == counted[0], opt.step_count
        return skipped

    waited_before = module.controller.update_wait_s
    skipped_ms: list[float] = []
    allocator_before: list[dict[str, int]] = []
    clocks: dict[str, Any] = {}
    from offload_optim import single_pass

    def before_timing() -> None:
        nonlocal spans
        allocator_before.append(_allocator_counts())
        single_pass.kernel_cpu_samples(clear=True)  # the warm-up's kernels are not timed
        spans = {"forward": [], "backward": [], "step": []}

    times = _timed_steps(
        step,
        warmup,
        steps,
        last_skipped,
        skipped_ms,
        before_timing=before_timing,
        clocks=clocks,
    )
    kernels_cpu = single_pass.kernel_cpu_samples(clear=True)
    allocator_after = _allocator_counts()
    out: dict[str, Any] = {
        "step_ms": _fastest5_mean_s(times) * 1e3,
        **_step_times(times),
        "setup_s": setup_s,
    }
    # fp16 overflow skips after warm-up and the steps right after them, left out of the
    # timing (see _timed_steps).
    out["skipped_steps_ms"] = [t * 1e3 for t in skipped_ms]
    out["timed_steps"] = len(times)
    out["gpu_clocks"] = clocks
    out["cpu_span_ms"] = cpu_span_summary(spans)
    # What the caching allocator did over the timed steps (ALLOCATOR_EVENTS).
    out["allocator_events"] = {
        k: allocator_after[k] - allocator_before[0][k] for k in ALLOCATOR_EVENTS
    }
    out["host_threads"] = torch.get_num_threads()
    out["budget_gib"] = budget_gib
    out["host_margin"] = host_margin
    out["polish_rounds"] = polish_rounds
    out["late_host_work"] = late_host_work
    out["measure_attention"] = bool(
        module.hardware is not None and module.hardware.attention_fwd_flop_per_s > 0
    )
    out["issue_ahead"] = module.hardware.issue_ahead
    out["backward_issue_factor"] = module.hardware.backward_issue_factor
    out["fuse_gelu"] = fuse_gelu
    out["issue_thread"] = issue_thread
    out["speculation_thread"] = speculation_thread
    out["plan_speculation_thread"] = plan_thread
    out["paced_ring"] = paced_ring
    out["ring_yields"] = ring_yields
    out["issuer_publishes"] = issuer_publishes
    out["stage_ahead"] = stage_ahead
    out["stage_in_backward"] = stage_in_backward
    out["stream_slots"] = stream_slots
    # What the thread count was set from: session 21's row with BENCH_HOST_THREADS set to
    # os.cpu_count() - 1 recorded 16 threads, so say what each was.
    out["cpus"] = {
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "bench_host_threads": os.environ.get("BENCH_HOST_THREADS"),
        # OpenMP's idle threads spin unless told to sleep (gpu_session.sh thrab's
        # THRAB_PASSIVE arm): set before the process starts, so recorded as given.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    out["switch_interval_s"] = sys.getswitchinterval()
    # Blocks a single-pass host Adam thread claims at a time (0: numba's equal shares, as
    # before session 52; gpu_session.sh claimab).
    out["host_adam_claim_blocks"] = single_pass.claim_blocks()
    # The host Adam kernels' CPU over the timed steps, with OFFLOAD_HOST_ADAM_CPU_PROBE=1
    # (gpu_session.sh cpuprobe): did a long one lose its cores to the machine?
    if single_pass.cpu_probe():
        out["host_kernel_cpu"] = kernel_cpu_summary(kernels_cpu)
    # Host optimizer steps run on past step() into the next forward; what that forward had
    # to wait for them is the part of the host step that nothing hid.
    out["forward_waited_for_host_ms_per_step"] = (
        (module.controller.update_wait_s - waited_before)
        / (warmup + len(times) + len(skipped_ms))
        * 1e3
    )
    out.update(_memory())
    out["issue_cost_us_reads"] = [issue_before, issue_cost_us()]
    plan = module.plan
    out["pred_peak_gib"] = plan.predicted_peak_bytes / GiB
    out["pred_step_ms"] = plan.predicted_step_time_s * 1e3
    # The simulated host worker's busy time in one step (host steps and publishes of the
    # cold step), beside the measured host_cycle's busy: the step minus it is the host
    # idle the simulator expects.
    out["pred_host_busy_ms"] = planned_host_busy_s(plan) * 1e3
    # What memory_optimize measured in use beside the plan (replay_bench.py takes it).
    out["device_bytes_in_use"] = plan.device_bytes_in_use
    if reprofiled is not None:
        out["reprofiled"] = reprofiled
    if rate_samples:
        out["host_rate_samples_gparam"] = [r / 1e9 for r in rate_samples]
        out["host_step_cost"] = host_cost
        # The plan's host rate (profile.host_adam_gparam) is the samples' median alone
        # (from session 57 on), or with BENCH_HOST_RATE=blend its geometric mean with the
        # profile's fused rate over the cost (sessions 21-56).
        out["host_rate_planned_from"] = "blend" if plan_cost is not None else "samples"
    if calibration is not None:
        out["host_rate_planned_from"] = "calibrated"
        out["calibration"] = calibration
    if pinned is not None:
        out["host_rate_planned_from"] = "pinned"
        out["plan_from"] = pinned.source
        # Whether the plan is the source row's: same predictions from the same inputs.
        out["plan_matches_source"] = math.isclose(
            out["pred_step_ms"], pinned.pred_step_ms, rel_tol=1e-9
        ) and math.isclose(out["pred_peak_gib"], pinned.pred_peak_gib, rel_tol=1e-9)
    if speculate:
        # Host-state parameters planned (and given buffers) to step under backward; None:
        # all of them.
        out["speculative_params"] = limit
        out["speculating_params"] = sum(
            rp.region.numel for rp in plan.regions if opt.optimizer.can_speculate(rp.region.index)
        )
    out["solver_s"] = plan.solve_time_s
    offloaded = [rp for rp in plan.regions if rp.placement is not ParamPlacement.RESIDENT]
    host = [rp for rp in plan.regions if rp.state is not StatePlacement.DEVICE]
    streamed = {st.index for st in module.storages if st.streamed}
    streamed_params = sum(rp.region.numel for rp in host if rp.region.index in streamed)
    out["regions"] = len(plan.regions)
    out["convert_on_device"] = module.convert_on_device
    out["offloaded_regions"] = len(offloaded)
    out["host_state_regions"] = len(host)
    if stream:
        if plan.streamed is not None:  # what the plan was made with (replay_bench.py)
            out["plan_streamed"] = dataclasses.asdict(plan.streamed)
        out["streamed_regions"] = len(streamed)
        out["streamed_params"] = streamed_params
        out["streamed_region_indices"] = sorted(streamed)
        out["stream_from"] = "plan" if stream_fraction is None else f"fraction {stream_fraction}"
        # The plan's streamed set, against ours where the bench edited it.
        planned = {rp.region.index for rp in plan.regions if rp.state is StatePlacement.STREAMED}
        if not_first:  # what _stream_not_first changed
            off, on = sorted(planned - streamed), sorted(streamed - planned)
            out["stream_from"] = (
                f"plan, region {off[0]} stepped on the host and region {on[0]} streamed"
                if off and on
                else "plan, its first streamed region kept"
            )
        if stream_max is not None:  # what _cap_streamed changed
            hosted = sorted(planned - streamed)
            out["stream_max"] = stream_max
            out["stream_from"] = (
                f"plan, regions {hosted} stepped on the host (BENCH_STREAM_MAX={stream_max})"
                if hosted
                else f"plan (BENCH_STREAM_MAX={stream_max}: nothing over it)"
            )
    # Bytes moved per step, for the floor: offloaded regions come up twice (forward and
    # backward); resident host-state regions once after their host step; host-state
    # gradients go down once; streamed regions' state goes up and down
    # (stream_copy_bytes), and only the others' step on the host.
    up_b, down_b = stream_copy_bytes(moments, fp16_io)
    h2d = (
        sum(2 * rp.region.size_bytes for rp in offloaded)
        + sum(rp.region.size_bytes for rp in host if rp.placement is ParamPlacement.RESIDENT)
        + streamed_params * up_b
    )
    d2h = sum(rp.region.size_bytes for rp in host) + streamed_params * down_b
    host_params = sum(rp.region.numel for rp in host) - streamed_params
    # The floor uses the measured profile (fp32 host Adam rate, whatever the kind plans with).
    hw = profile_hardware("cuda", progress=False)
    out["profile_host_adam_gparam"] = hw.host_adam_params_per_s / 1e9
    out["floor_parts_ms"] = {
        "h2d": h2d / hw.h2d_bytes_per_s(GiB) * 1e3,
        "d2h": d2h / hw.d2h_bytes_per_s(GiB) * 1e3,
        "host_adam": host_params / hw.host_adam_params_per_s * 1e3,
    }
    if streamed_params:
        # The issue's floor counts every host-resident parameter at the host Adam rate;
        # the floor above is the plan's own (streamed ones step on the device and cross
        # PCIe instead). Both are kept, so that neither hides the other.
        out["floor_parts_ms"]["host_adam_all_host_state"] = (
            sum(rp.region.numel for rp in host) / hw.host_adam_params_per_s * 1e3
        )
    # The bytes behind the floor's copy and host parts (host_memory_bound.py reads them).
    out["floor_bytes"] = {"h2d": h2d, "d2h": d2h, "host_params": host_params}
    # The profile the plan was made with (plan_predict.py takes these to replay it).
    plan_hw = module.hardware or hw
    out["steps_under_floor"] = steps_under_floor(
        out["steps_ms"],
        out["floor_parts_ms"],
        plan_hw.host_adam_params_per_s / hw.host_adam_params_per_s,
    )
    out["profile"] = {
        "h2d_gbps": plan_hw.h2d_bytes_per_s(GiB) / 1e9,
        "d2h_gbps": plan_hw.d2h_bytes_per_s(GiB) / 1e9,
        "peak_tflops": plan_hw.compute_flop_per_s / 1e12,
        "efficiency": plan_hw.compute_efficiency,
        "host_adam_gparam": plan_hw.host_adam_params_per_s / 1e9,
        "host_convert_gelem": plan_hw.host_convert_elems_per_s / 1e9,
        "op_overhead_us": plan_hw.op_overhead_s * 1e6,
        "device_memory_tbps": plan_hw.device_memory_bytes_per_s / 1e12,
        "host_copy_contention": plan_hw.host_copy_contention,
        "stream_up_fraction": plan_hw.stream_up_fraction,
        "stream_host_charge": plan_hw.stream_host_charge,
    }
    # The whole profile too (bandwidth curves included), so that replay_bench.py replays
    # the plan exactly instead of scaling the default curves to the plateaus above.
    out["hardware"] = json.loads(plan_hw.to_json())
    if speculate:
        out["speculative_step_cost"] = spec_cost
    report = opt.last_step
    if report is not None and report.region_steps:
        out["host_step_hidden_fraction"] = report.hidden_fraction()
        # Host Adam time inside the training loop (last timed step), against the floor's
        # standalone rate: the gap is what concurrent copies and compute cost it.
        out["host_step_ms_in_loop"] = report.host_step_s * 1e3
        # fp16 steps no region before backward's answer: a step takes at least the time
        # from backward's call to the first host step plus the host steps' span.
        host_steps = [t for t in report.region_steps if t.on_host]
        if host_steps and report.backward_start_s is not None:
            first = min(t.start_s for t in host_steps)
            out["backward_to_first_host_step_ms"] = (first - report.backward_start_s) * 1e3
            out["host_step_span_ms"] = (max(t.end_s for t in host_steps) - first) * 1e3
    timed_reports = opt.recent_steps()[-len(times) - len(skipped_ms) :]
    cycle = _host_cycle(timed_reports)
    if cycle:
        out["host_cycle"] = cycle
    # Time spent issuing the streamed regions' device work per step (median over the
    # timed steps; on the host worker, or on the issuing thread with issue_thread), which
    # the planner does not charge: unprofiled, unlike the traces' issue spans.
    issue_ms = [
        sum(t.issue_s for t in rep.region_steps if t.streamed) * 1e3 for rep in timed_reports
    ]
    if any(issue_ms):
        out["streamed_issue_ms_per_step"] = statistics.median(issue_ms)
    # With paced_ring, what the issuing thread waited for free ring slots per step, left
    # out of the issue time above (session 28's paced rows, of 9730ec3, counted it there).
    waits_ms = [
        sum(t.paced_wait_s for t in rep.region_steps if t.streamed) * 1e3 for rep in timed_reports
    ]
    if any(waits_ms):
        out["streamed_paced_wait_ms_per_step"] = statistics.median(waits_ms)
    # The ring's copies up, timed on the device ([Note: timing the ring's copies up] in
    # offload_optim/streamed.py): the share of the profile's H2D rate they ran at, against
    # the plan's stream_up_fraction.
    ring = check_stream_rate(opt, last=len(timed_reports)) if timed_reports else None
    if ring is not None:
        out["ring_up"] = {
            "loop_fraction": ring.loop_fraction,
            "planned_fraction": ring.planned_fraction,
            "gbps": ring.up_bytes / ring.measured_s / 1e9,
            "bytes_per_step": ring.up_bytes,
            "ms_per_step": ring.measured_s * 1e3,
            "steps": ring.steps,
        }
    # Ring chunks stepped from staged slots, warmup and timed steps (stage_ahead).
    out["staged_chunks"] = opt.optimizer.staged_chunks
    if speculate:
        out["undone_steps"] = opt.undone_steps  # of the warmup and timed steps
        if report is not None:  # the last timed step: how many regions stepped early
            out["speculated_regions"] = report.speculated_regions
    if pair_full_gpu and host:
        # Host steps run on past step() into the next step, which would be the peer's.
        out["paired_full_gpu"] = {"error": "the plan has host-state regions"}
    elif pair_full_gpu:
        # After the row's own measurement (its peak is its own): full-GPU training built
        # beside it and the two stepped in turn (interleaved_steps).
        recipe = bench_pair_recipe()
        full = _full_gpu_steps(workload, recipe)  # its closures hold the model
        applied_before = opt.step_count
        ours_s, full_s = interleaved_steps(step, full.step, warmup, steps, torch.cuda.synchronize)
        out["paired_full_gpu"] = pair_summary(ours_s, full_s)
        out["paired_full_gpu"]["activation"] = peer_activation()
        out["paired_full_gpu"]["grad_scaler"] = full.loss_scale() is not None
        out["paired_full_gpu"]["recipe"] = recipe
        # fp16 overflow skips among ours' paired steps (short steps, so they flatter it).
        out["paired_full_gpu"]["ours_skipped_steps"] = (
            warmup + steps - (opt.step_count - applied_before)
        )
        del full  # free the full-GPU model before the profiled steps
        gc.collect()
    if profile_dir is not None:
        # Then the host steps still queued: each forward waiting on the step before's host
        # steps is in the window, and so are the host worker's region steps.
        _profile_steps(out, step, profile_dir / f"{workload}_{kind}", after=opt.synchronize)
    module.close()
    return out


def _profile_steps(
    out: dict[str, Any],
    step: Callable[[], None],
    stem: Path,
    after: Callable[[], None] | None = None,
) -> None:
    """Profile :func:`bench_profile_steps` calls of ``step`` (one training step each),
    then ``after()`` if given, on every thread, after the row's measurement: ``stem``'s
    ``profile_*.txt`` (the top operators) and ``trace_*.json.gz`` (``step_trace.py``,
    ``step_tail.py``, ``issue_compare.py`` read it); ``out`` gets ``profile_streams`` and
    ``profile_steps``, or ``profile_error``.

    The measurement is printed first, in case the profile runs past the parent's timeout
    (W4 in session 22: the row took 200 s with its two profiled steps and was lost whole);
    the parent keeps the last result line it got. A failing profile is reported, not fatal.
    """
    import torch
    from step_trace import all_threads_config
    from torch.profiler import ProfilerActivity, profile

    print(RESULT_TAG + json.dumps({**out, "ok": True, "profile_error": "not finished"}), flush=True)
    try:
        count = bench_profile_steps()  # a bad count is a profile error, not a lost row
        # Every thread: the host worker's and the autograd engine's operators too.
        with profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            experimental_config=all_threads_config(),
        ) as prof:
            for _ in range(count):
                step()
            if after is not None:
                after()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        stem.parent.mkdir(parents=True, exist_ok=True)
        (stem.parent / f"profile_{stem.name}.txt").write_text(table)
        out["profile_streams"] = _save_trace(prof, stem.parent / f"trace_{stem.name}.json.gz")
        out["profile_steps"] = count  # profile_streams covers them (and their host steps)
    except Exception as exc:  # keep the measurement, say what broke
        out["profile_error"] = f"{type(exc).__name__}: {exc}"


def _force_streamed(module: Any, fraction: float) -> None:
    """BENCH_STREAM_FRACTION: stream ``fraction`` of the host-state parameters, spread over
    forward order: a region is streamed while the streamed share of the regions so far
    stays at most ``fraction`` (counting half of the region itself). Every host-state
    region is a candidate: in session 22's W4 row that left out the 4.6 G parameters that
    may speculate, only 0.39 G were streamed, yet the host reached only 13 regions under
    backward and stepped the other 71 after it."""
    total = chosen = 0
    for st in module.storages:
        if not st.host_state:
            continue
        total += st.numel
        if chosen + st.numel / 2 <= fraction * total:
            st.streamed = True
            chosen += st.numel


def _hybrid_adam_flag(env: str, parameter: str) -> bool:
    """A ``HybridAdam`` flag set by ``env``: "0" False, anything else True, unset the
    optimizer's own default for ``parameter``."""
    value = os.environ.get(env)
    if value is None:
        from offload_optim import HybridAdam

        return bool(inspect.signature(HybridAdam).parameters[parameter].default)
    return value != "0"


def bench_profile_steps() -> int:
    """BENCH_PROFILE_STEPS=N: how many steps ``--profile-dir`` profiles after a row's
    measurement (default 2; with more, the trace holds more than one forward that follows
    a profiled step: in session 42's W3 traces the one forward there came after a step
    whose hooks speculated fewer regions than the timed steps' did). ValueError unless a
    whole number >= 1."""
    text = os.environ.get("BENCH_PROFILE_STEPS", "2")
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"BENCH_PROFILE_STEPS={text!r}: give a whole number of steps >= 1")
    return n


def bench_stream_not_first() -> bool:
    """BENCH_STREAM_NOT_FIRST=1: step the plan's first streamed region (in forward order)
    on the host and stream the next host-state region after it instead (the plan not
    told; :func:`_stream_not_first`)."""
    return os.environ.get("BENCH_STREAM_NOT_FIRST", "0") != "0"


def _stream_not_first(storages: Sequence[Any]) -> tuple[int, int] | None:
    """BENCH_STREAM_NOT_FIRST: the first streamed storage (forward order) goes back to a
    host step, and the first host-state storage after it that is not streamed and holds
    parameters is streamed in its place. Returns (the region now stepped on the host, the
    region now streamed), or None where there is no such pair (nothing changed); rows
    read the move back from the plan's streamed regions and the storages'.

    In session 40's W3 plan the first streamed region held the embeddings and the first
    blocks: the last gradients of backward and the first parameters of the forward, so
    its state's trip up and back is on the step's critical path; the replay put the plan
    with it moved one host-state region on at 229.8 ms against 228.6
    (``replay_bench.py --restate``), so only a GPU can say which is faster."""
    first = next((i for i, st in enumerate(storages) if st.streamed), None)
    if first is None:
        return None
    after = next(
        (
            i
            for i in range(first + 1, len(storages))
            if storages[i].host_state and not storages[i].streamed and storages[i].numel > 0
        ),
        None,
    )
    if after is None:
        return None
    storages[first].streamed = False
    storages[after].streamed = True
    return storages[first].index, storages[after].index


def _env_int(name: str, least: int) -> int | None:
    """The int environment variable ``name`` (at least ``least``), or None where unset or
    empty; a clear error for anything else."""
    env = os.environ.get(name)
    if not env:
        return None
    try:
        value = int(env)
    except ValueError:
        raise ValueError(f"{name}={env!r} is not an int") from None
    if value < least:
        raise ValueError(f"{name}={value} must be >= {least}")
    return value


def bench_stream_max() -> int | None:
    """BENCH_STREAM_MAX=N (an int >= 0): keep only the plan's first N streamed regions (in
    forward order) streamed and step the rest on the host (the plan not told;
    :func:`_cap_streamed`); unset: as planned."""
    return _env_int("BENCH_STREAM_MAX", 0)


def _cap_streamed(storages: Sequence[Any], most: int) -> list[int]:
    """BENCH_STREAM_MAX: the streamed storages after the first ``most`` (forward order)
    go back to host steps. Returns the regions now stepped on the host.

    W3's measured steps on record rise with the regions its plans streamed, where the
    simulator saw little difference (BENCHMARKS.md, session 50): 238.5-258.9 ms with two
    (the 5 fastest steps of each row, sessions 42-50), 248.1-260.1 with three and
    255.1-276.2 with four; replayed, session 50's plan of three with region 5 stepped on
    the host instead predicts 4.5 ms slower (``replay_bench.py --restate 5=host``). One
    plan run both ways on one machine says which it is."""
    streamed = [i for i, st in enumerate(storages) if st.streamed]
    moved = streamed[most:]
    for i in moved:
        storages[i].streamed = False
    return [storages[i].index for i in moved]


def bench_stream_write() -> bool:
    """Whether resident streamed regions are written on the device: unless
    BENCH_STREAM_WRITE=0."""
    return os.environ.get("BENCH_STREAM_WRITE", "1") != "0"


def bench_late_host_work() -> bool:
    """Whether the plan moves host work to later regions (``memory_optimize``'s
    ``late_host_work``, the default): unless BENCH_LATE_HOST_WORK=0."""
    return os.environ.get("BENCH_LATE_HOST_WORK", "1") != "0"


def bench_stream_slots() -> int:
    """Buffer sets of the streamed regions' ring, and so chunks staged in the backward:
    BENCH_STREAM_SLOTS where set (an int >= 2), else ``offload_optim``'s ``STREAM_SLOTS``."""
    from offload_optim.streamed import STREAM_SLOTS

    slots = _env_int("BENCH_STREAM_SLOTS", 2)
    return STREAM_SLOTS if slots is None else slots


def bench_budget_gib(workload: str) -> float:
    """The budget (GiB) our kinds plan ``workload`` under: BENCH_BUDGET_GIB where set (a
    diagnostic row, e.g. W3 with room for everything to stay on the device, which
    ``targets.py`` leaves out of every target), else the workload's own."""
    env = os.environ.get("BENCH_BUDGET_GIB")
    if not env:
        return float(WORKLOADS[workload][3])
    try:
        gib = float(env)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"BENCH_BUDGET_GIB must be a positive number of GiB, got {env!r}")
    return gib


def bench_host_margin() -> float:
    """How many times slower than its measured rate the plan takes the host's Adam step to
    run: BENCH_HOST_MARGIN (at least 1; default 1, the measured rate). Session 46's W3 rows
    of one plan kept the host busy 150-192 ms a step (``host_cycle``), and their slowest
    steps waited for the host; a plan made for a slower host streams more and leans less on
    its fast steps. Only the plan is told: the optimizer steps as planned. Rows record
    ``host_margin``, and their ``hardware`` the slowed rate."""
    env = os.environ.get("BENCH_HOST_MARGIN")
    if not env:
        return 1.0
    try:
        margin = float(env)
    except ValueError:
        margin = math.nan
    if not math.isfinite(margin) or margin < 1:
        raise ValueError(f"BENCH_HOST_MARGIN must be a number >= 1, got {env!r}")
    return margin


HOST_RATES = ("blend", "samples")
"""What BENCH_HOST_RATE may name (:func:`bench_host_rate`)."""


def bench_host_rate() -> str:
    """Which host Adam rate the sampling ``ours`` kinds plan with: BENCH_HOST_RATE's, else
    ``samples``, the median of the kind's three rate samples alone (from session 57 on);
    ``blend``: the geometric mean of that and the cached profile's fused rate over the
    kind's cost (sessions 21-56). The profile's fused rate read 1.40, 1.65 and 3.30
    Gparam/s on the machines of sessions 47, 44 and 48, where their processes read
    3.5-5.2, and 2.84 and 4.03 in two processes of session 56's lease. With the backward
    beside the host priced at ``BACKWARD_ISSUE_FACTOR``, the 106 rows of sessions 45-56
    replayed on their own plans predict within 15% of their run means in 97 cases from the
    samples against 92 from the blend (replanned: 94 against 91; BENCHMARKS.md, session
    56)."""
    rate = os.environ.get("BENCH_HOST_RATE") or "samples"
    if rate not in HOST_RATES:
        raise ValueError(f"BENCH_HOST_RATE={rate!r}; known: {', '.join(HOST_RATES)}")
    return rate


def host_margin_inputs(
    host_cost: float | None, host_rate: float | None, margin: float
) -> tuple[float | None, float | None]:
    """``memory_optimize``'s ``host_step_cost`` and ``host_step_params_per_s`` (the host Adam
    step's time over the profile's fused fp32 step, and its rate in parameters/s) with the
    host ``margin`` times slower: the cost times it and the rate over it, or, where neither
    is given, a cost of ``margin`` (the profile's rate over it). ``margin`` 1 passes them
    as they are."""
    if margin == 1.0:
        return host_cost, host_rate
    if host_rate is not None:
        host_rate /= margin
    if host_cost is not None:
        host_cost *= margin
    elif host_rate is None:
        host_cost = margin
    return host_cost, host_rate


def bench_pair_recipe() -> str:
    """The recipe of the full-GPU training paired with ours (BENCH_PAIR_FULL_GPU):
    BENCH_PAIR_RECIPE's, else "master" (:func:`_full_gpu_steps`)."""
    recipe = os.environ.get("BENCH_PAIR_RECIPE", "master")
    if recipe not in RECIPES:
        raise ValueError(f"BENCH_PAIR_RECIPE={recipe!r}; known: {', '.join(RECIPES)}")
    return recipe


def bench_full_gpu_scaler() -> bool:
    """Whether full-GPU training scales its loss (``torch.amp.GradScaler``): unless
    BENCH_FULL_GPU_SCALER=0 (as every full-GPU row before session 39 ran)."""
    return os.environ.get("BENCH_FULL_GPU_SCALER", "1") != "0"


def bench_fuse_gelu() -> bool:
    """Whether this run fuses GPT-2's GELU: unless BENCH_FUSE_GELU=0."""
    return os.environ.get("BENCH_FUSE_GELU", "1") != "0"


def peer_activation() -> str:
    """The MLP activation the peers' models are built with: ``gelu_pytorch_tanh`` (one
    ``aten.gelu``) where ours fuses GPT-2's written-out GELU into the same operation
    (:func:`bench_fuse_gelu`), else GPT-2's own (``models.DEFAULT_ACTIVATION``)."""
    from offload_gpt_example.models import DEFAULT_ACTIVATION

    return "gelu_pytorch_tanh" if bench_fuse_gelu() else DEFAULT_ACTIVATION


def _measure_peer(step: Callable[[], None], warmup: int, steps: int) -> dict[str, Any]:
    """A peer kind's measurement of ``step``: the peak counted from here, the step times
    (:func:`_timed_steps`), the memory peaks and ``gpu_clocks`` over the timed steps."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    clocks: dict[str, Any] = {}
    times = _timed_steps(step, warmup, steps, clocks=clocks)
    out: dict[str, Any] = {"step_ms": _fastest5_mean_s(times) * 1e3, **_step_times(times)}
    out.update(_memory())
    out["gpu_clocks"] = clocks
    return out


class FullGpuSteps(NamedTuple):
    """Full-GPU training's step functions (:func:`_full_gpu_steps`)."""

    step: Callable[[], None]
    """A training step: forward, backward, the optimizer (through the scaler, if any)."""
    fwd_bwd: Callable[[], None]
    """Forward and backward alone."""
    zero: Callable[[], None]
    """Drop the gradients."""
    loss: Callable[[], float]
    """The loss at the current weights (no gradients; a host sync)."""
    loss_scale: Callable[[], float | None]
    """The scaler's loss scale (None unscaled): it halves on each step it skips."""
    parameters: Callable[[], list[Any]]
    """The model's parameters (the optimizer's)."""
    optimizer: Any
    """The fused Adam (its state, for tests)."""


def _grads(tensors: list[Any]) -> list[Any]:
    """The gradients of ``tensors``, each of which must have one."""
    out = []
    for t in tensors:
        if t.grad is None:
            raise RuntimeError("a parameter has no gradient after backward")
        out.append(t.grad)
    return out


def _full_gpu_steps(
    workload: str, recipe: str = "fp16", device: str = "cuda", scaled: bool | None = None
) -> FullGpuSteps:
    """Full-GPU training of ``workload`` built on ``device`` ("cuda"; "cpu" for tests) by
    ``recipe``:

    - "fp16": fp16 weights and fp16 Adam state, the loss scaled as ``scaled`` says (None:
      unless BENCH_FULL_GPU_SCALER=0). Its weights diverge in a few steps
      (benchmarks/peer_training.py; on the H200 in session 40 its W3 loss went to nan).
    - "amp": torch's mixed-precision recipe: an fp32 model (fp32 weights, gradients and
      Adam state) run under fp16 autocast, which casts each weight to fp16 as an
      operation uses it; the loss scaled.
    - "master": fp16 weights with fp32 master copies and fp32 Adam state (what ours keeps,
      all on the device): forward and backward in fp16 as ours runs them, the gradients
      widened into fp32 buffers, fused Adam on the masters through a GradScaler, the
      masters narrowed back into the weights; the loss scaled.
    """
    import contextlib

    import torch

    from offload_gpt_example.models import build_model, lm_loss, random_batch

    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}; known: {', '.join(RECIPES)}")
    amp = recipe == "amp"
    name, batch, seq, _ = WORKLOADS[workload]
    model = build_model(
        name,
        device=device,
        dtype=torch.float32 if amp else torch.float16,
        seq_len=seq,
        activation=peer_activation(),
    )
    data = random_batch(batch, seq, device=device)
    params: list[torch.Tensor] = list(model.parameters())

    def autocast() -> contextlib.AbstractContextManager[Any]:
        if amp:
            return torch.autocast(device, dtype=torch.float16)
        return contextlib.nullcontext()

    masters: list[torch.Tensor] = []
    if recipe == "master":
        masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        for m in masters:
            m.grad = torch.zeros_like(m)  # kept: each step's widened gradients
    master_grads = _grads(masters)
    opt = torch.optim.Adam(masters or params, lr=1e-4, fused=True)
    # fp16 gradients without a loss scale underflow: in a 4-layer GPT-2 XL-wide model at
    # W3's 8 x 1024 tokens, every element of the blocks' output gradients came out zero or
    # subnormal (benchmarks/grad_underflow.py, session 39; at 2**16, 0.1% zero and at
    # most 3.3% subnormal). A GradScaler (torch's fp16 recipe, 2**16 to start, its inf
    # check fused into the Adam step, no host sync) gives gradients of full range, as
    # ours' dynamic loss scale (also 2**16 to start) does. fp16 Adam state still rounds
    # most second moments to zero, and the weights diverge in a few steps
    # (benchmarks/peer_training.py): "amp" and "master" keep the state in fp32 as ours does.
    if scaled is None:
        scaled = bench_full_gpu_scaler()
    scaler = torch.amp.GradScaler(device) if recipe != "fp16" or scaled else None

    def fwd_bwd() -> None:
        with autocast():
            logits = model(**data)
        loss = lm_loss(logits, data["input_ids"])
        torch.autograd.backward(loss if scaler is None else scaler.scale(loss))

    def zero() -> None:
        for p in params:
            p.grad = None

    def step() -> None:
        fwd_bwd()
        if masters:
            torch._foreach_copy_(master_grads, _grads(params))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if masters:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        zero()

    def loss_now() -> float:
        with torch.no_grad(), autocast():
            return float(lm_loss(model(**data), data["input_ids"]))

    def scale() -> float | None:
        return None if scaler is None else float(scaler.get_scale())

    return FullGpuSteps(step, fwd_bwd, zero, loss_now, scale, lambda: list(params), opt)


def _full_gpu(
    workload: str,
    warmup: int,
    steps: int,
    profile_dir: Path | None = None,
    recipe: str = "fp16",
) -> dict[str, Any]:

    full = _full_gpu_steps(workload, recipe)
    step, fwd_bwd, zero = full.step, full.fwd_bwd, full.zero

    def compute_only() -> None:
        fwd_bwd()
        zero()

    # Forward and backward at the initial weights too, before any step: with fp16 Adam
    # state the weights diverge within a few steps (benchmarks/peer_training.py), and
    # the kernels then run on overflowing data.
    loss_before = full.loss()
    first = _fastest5_mean_s(_timed_steps(compute_only, warmup, steps)) * 1e3
    issue_before = issue_cost_us()
    out = _measure_peer(step, warmup, steps)
    out["grad_scaler"] = full.loss_scale() is not None
    out["recipe"] = recipe
    out["issue_cost_us_reads"] = [issue_before, issue_cost_us()]
    # Whether it trained: the loss before the first step and after the last, the scale
    # the scaler ended at (2**16 to start; halved on each step it skipped).
    out["loss_before"] = loss_before
    out["loss_after"] = full.loss()
    out["loss_scale_after"] = full.loss_scale()
    out["fwd_bwd_first_ms"] = first
    out["fwd_bwd_ms"] = _fastest5_mean_s(_timed_steps(compute_only, warmup, steps)) * 1e3
    if profile_dir is not None:
        # Beside ours' trace of the same run: what each issues per step (issue_compare.py).
        suffix = "" if recipe == "fp16" else f"_{recipe}"
        _profile_steps(out, step, profile_dir / f"{workload}_full_gpu{suffix}")
    return out


def _fsdp2(workload: str, warmup: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from offload_gpt_example.models import build_model, lm_loss, random_batch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(s.getsockname()[1]))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    name, batch, seq, _ = WORKLOADS[workload]
    model = build_model(
        name,
        device="cpu",
        dtype=torch.float32,
        seq_len=seq,
        init_device="cuda",
        activation=peer_activation(),
    )
    mesh = init_device_mesh("cuda", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    data = random_batch(batch, seq, device="cuda")

    def step() -> None:
        torch.autograd.backward(lm_loss(model(**data), data["input_ids"]))
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = _measure_peer(step, warmup, steps)
    dist.destroy_process_group()
    return out


def _torchao(workload: str, warmup: int, steps: int) -> dict[str, Any]:
    import torch
    from torchao.optim import CPUOffloadOptimizer

    from offload_gpt_example.models import build_model, lm_loss, random_batch

    name, batch, seq, _ = WORKLOADS[workload]
    model = build_model(
        name, device="cuda", dtype=torch.bfloat16, seq_len=seq, activation=peer_activation()
    )
    data = random_batch(batch, seq, device="cuda")
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=1e-4)

    def step() -> None:
        torch.autograd.backward(lm_loss(model(**data), data["input_ids"]))
        opt.step()
        opt.zero_grad()

    out = _measure_peer(step, warmup, steps)
    return out


def child_main(args: argparse.Namespace) -> None:
    profile_dir = Path(args.profile_dir) if args.profile_dir else None
    try:
        if args.child in OURS_KINDS:
            result = _ours(args.workload, args.child, args.warmup, args.steps, profile_dir)
        elif args.child in FULL_GPU_KINDS:
            recipe = FULL_GPU_KINDS[args.child]
            result = _full_gpu(args.workload, args.warmup, args.steps, profile_dir, recipe)
        elif args.child == "fsdp2":
            result = _fsdp2(args.workload, args.warmup, args.steps)
        elif args.child == "torchao":
            result = _torchao(args.workload, args.warmup, args.steps)
        else:
            raise ValueError(f"unknown kind {args.child!r}; known: {', '.join(KINDS)}")
        if args.child not in OURS_KINDS:
            result["activation"] = peer_activation()
        result["ok"] = True
    except Exception as exc:  # reported as a row, never fatal
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    print(RESULT_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------
# Parent side: run every measurement in its own process, tabulate
# --------------------------------------------------------------------------------------


def run_child(workload: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--workload",
        workload,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    if args.profile_dir:
        cmd += ["--profile-dir", args.profile_dir]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        # A result printed before the timeout (the measurement, before its profile) stands.
        partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        got = [ln for ln in partial.splitlines() if ln.startswith(RESULT_TAG)]
        if not got:
            return {"ok": False, "error": f"timed out after {args.timeout_s} s"}
        kept: dict[str, Any] = json.loads(got[-1][len(RESULT_TAG) :])
        kept["timed_out_after_s"] = args.timeout_s
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


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if not r.get("ok"):
        return f"failed ({r.get('error', '?')[:60]})"
    mean = r.get("step_mean_ms")  # rows from f16d73d on
    over_run = "" if mean is None else f" (run: {mean:.0f})"
    under = r.get("steps_under_floor")
    if under:  # the 5 fastest are not a steady rate: see steps_under_floor
        over_run += f" [{under} of {len(r['steps_ms'])} steps under the floor]"
    return f"{r['step_ms']:.0f} ms{over_run} / {r['peak_alloc_gib']:.2f} GiB"


HOST_FLOOR_PARTS = ("host_adam", "host_adam_all_host_state")
"""The parts of ``floor_parts_ms`` that are host-state parameters over the profile's fused
host Adam rate (``profile_host_adam_gparam``)."""

PROFILE_HOST_DISTURBED = 1.5
"""How many times slower than torch's fused host Adam ran in the benchmark's own processes
a cached profile's rate must read for an ``ours`` child to profile again
(:func:`reprofile_if_disturbed`). Session 47's cached profile read 1.40 Gparam/s, and every
process of that machine timed the fused step at 3.55-5.18 Gparam/s
(:func:`fused_rate_in_process_gparam`)."""


def fused_rate_in_process_gparam(r: dict[str, Any]) -> float | None:
    """Torch's fused fp32 host Adam rate as a row's own process read it (Gparam/s): the
    median of its kind's rate samples (``host_rate_samples_gparam``) times its
    ``host_step_cost`` (the kind's step time over the fused step's, timed back to back).
    None for rows that sampled neither (pinned rows, kinds planned at the profile's rate)."""
    samples, cost = r.get("host_rate_samples_gparam"), r.get("host_step_cost")
    if not samples or not cost:
        return None
    return float(statistics.median(samples)) * float(cost)


def floor_host_gparam(r: dict[str, Any], host_gparam: float | None) -> float | None:
    """The host Adam rate (Gparam/s) :func:`floor_parts` takes row ``r``'s host parts at
    when it is not the profile's: ``host_gparam`` (torch's fused step as the row's machine
    timed it in its own processes) where that is faster than the profile's reading, else
    None. A floor is a lower bound on the step, so of two readings of the host it takes the
    faster: session 48's profile read 3.30 Gparam/s (the median of three reads) where the
    machine's processes read 4.03, and at 3.30 W4's floor (1589.5 ms) was over its step."""
    profile = r.get("profile_host_adam_gparam")
    if host_gparam is None or profile is None or not host_gparam > float(profile):
        return None
    return host_gparam


def floor_parts(
    r: dict[str, Any], full: dict[str, Any] | None, host_gparam: float | None = None
) -> dict[str, float]:
    """The parts of row ``r``'s floor (ms): its ``floor_parts_ms`` (the H2D and D2H bytes
    over the profiled rates, host Adam over every host-state parameter) and, as
    ``gpu_compute``, full-GPU training's forward and backward when ``full`` ran.

    ``host_gparam``: torch's fused host Adam rate read beside the row (Gparam/s; e.g. the
    median of its machine's :func:`fused_rate_in_process_gparam`). Where it is faster than
    the profile's reading, the host parts are taken at it (:func:`floor_host_gparam`): a
    floor set by a host read slow while it was profiled would credit every row with that
    slowness (sessions 44, 47 and 48)."""
    parts = dict(r.get("floor_parts_ms", {}))
    faster = floor_host_gparam(r, host_gparam)
    if faster is not None:
        for key in HOST_FLOOR_PARTS:
            if key in parts:
                parts[key] *= r["profile_host_adam_gparam"] / faster
    if full and full.get("ok"):
        parts["gpu_compute"] = full["fwd_bwd_ms"]
    return parts


def issue_floor(
    r: dict[str, Any], full: dict[str, Any] | None, host_gparam: float | None = None
) -> tuple[float, str] | None:
    """The issue's floor for row ``r`` (ms, and which part sets it): the largest of its
    :func:`floor_parts` (``host_gparam`` as there). None when nothing is known, or when
    every part is 0 (W1 run without a full-GPU row: nothing crosses PCIe or steps on the
    host; its table cell divided by that floor ended session 55's run before its JSON)."""
    parts = floor_parts(r, full, host_gparam)
    if not parts:
        return None
    key = max(parts, key=lambda k: parts[k])
    if not parts[key] > 0:
        return None
    return parts[key], key


REFERENCE_FULL_GPU = ("full_gpu_master", "full_gpu")
"""The full-GPU kinds the issue's ratios take, in order of preference: fp32 masters where
a run has them (the same precision as ours; it trains), else fp16 weights and state (every
run before session 40; its weights diverge, benchmarks/peer_training.py), each only where
its row did not diverge (:func:`reference_full_gpu`)."""


def trained(result: dict[str, Any]) -> bool | None:
    """Whether a full-GPU row's training trained: its loss after the timed steps finite
    and below the loss before them (None: rows before session 39 record neither)."""
    before, after = result.get("loss_before"), result.get("loss_after")
    if before is None or after is None:
        return None
    return math.isfinite(after) and after < before


def reference_full_gpu_kind(rows_by_kind: dict[str, list[dict[str, Any]]]) -> str | None:
    """Of one workload's rows of each kind, the full-GPU kind the ratios and the floor
    take (:data:`REFERENCE_FULL_GPU`): the first of those kinds with a row that did not
    diverge (:func:`trained` not False: a diverged row times its kernels on overflowing
    data, at a higher clock than training's; rows before session 39 record no loss)."""
    for kind in REFERENCE_FULL_GPU:
        if any(trained(r) is not False for r in rows_by_kind.get(kind, [])):
            return kind
    return None


def reference_full_gpu(by_kind: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Of one workload's rows by kind (one run), the full-GPU row the ratios and the floor
    take (:func:`reference_full_gpu_kind`), ok or not."""
    kind = reference_full_gpu_kind({k: [r] for k, r in by_kind.items()})
    return None if kind is None else by_kind[kind]


def _ratio(r: dict[str, Any], peer: dict[str, Any] | None) -> str:
    """``r``'s step over ``peer``'s, by the 5 fastest and (in brackets) over the run."""
    if peer is None or not peer.get("ok"):
        return "-"
    cell = f"{r['step_ms'] / peer['step_ms']:.3f}"
    if "step_mean_ms" in r and "step_mean_ms" in peer:
        cell += f" ({r['step_mean_ms'] / peer['step_mean_ms']:.3f})"
    return cell


def markdown(results: dict[str, dict[str, dict[str, Any]]], meta: dict[str, str]) -> str:
    lines = [
        f"### {meta['date']} - commit {meta['commit']} - {meta['gpu']} - torch {meta['torch']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| workload | ours (step / peak) | predicted (step / peak) | floor | ours / floor "
        "| full GPU | FSDP2 CPU offload | ours / FSDP2 | torchao | ablation | ours bf16 moments "
        "| ours, host conversion | ours, bf16 training |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w, by_kind in results.items():
        name, batch, seq, budget = WORKLOADS[w]
        ours = by_kind.get("ours")
        full = reference_full_gpu(by_kind)
        pred = floor = ratio_floor = ratio_fsdp = "-"
        if ours and ours.get("ok"):
            pred = f"{ours['pred_step_ms']:.0f} ms / {ours['pred_peak_gib']:.2f} GiB"
            found = issue_floor(ours, full)
            if found:
                floor_ms, key = found
                floor = f"{floor_ms:.0f} ms ({key})"
                ratio_floor = f"{ours['step_ms'] / floor_ms:.2f}"
            fsdp = by_kind.get("fsdp2")
            if fsdp and fsdp.get("ok"):
                ratio_fsdp = f"{ours['step_ms'] / fsdp['step_ms']:.2f}"
        lines.append(
            f"| {w} {name} {batch}x{seq} @ {budget} GiB | {_cell(ours)} | {pred} | {floor} "
            f"| {ratio_floor} | {_cell(full)} | {_cell(by_kind.get('fsdp2'))} | {ratio_fsdp} "
            f"| {_cell(by_kind.get('torchao'))} | {_cell(by_kind.get('ablation'))} "
            f"| {_cell(by_kind.get('ours_bf16m'))} | {_cell(by_kind.get('ours_hostconv'))} "
            f"| {_cell(by_kind.get('ours_bf16'))} |"
        )
    # Every variant of ours, with its own prediction (speculation and bf16 moments are
    # columns of neither table above).
    variants = [
        (w, kind, r)
        for w, by_kind in results.items()
        for kind, r in by_kind.items()
        if kind in OURS_KINDS and r.get("ok")
    ]
    if variants:
        lines += [
            "",
            "| workload | kind | step / peak | predicted (step / peak) | floor "
            "| / floor (run) | / FSDP2 (run) | / torchao (run) | / full GPU (run) "
            "| host step in the loop "
            "| host threads | undone steps | regions speculated (last step) "
            "| host per step: busy / idle inside / idle after last / idle before first |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for w, kind, r in variants:
            # The issue's ratios, each against a peer measured in the same call.
            peers = results[w]
            full = reference_full_gpu(peers)
            found = issue_floor(r, full)
            floor_cell = ratio_floor = "-"
            if found:
                floor_ms, key = found
                floor_cell = f"{floor_ms:.0f} ms ({key})"
                ratio_floor = f"{r['step_ms'] / floor_ms:.3f}"
                if "step_mean_ms" in r:
                    ratio_floor += f" ({r['step_mean_ms'] / floor_ms:.3f})"
            ratios = (
                f"| {floor_cell} | {ratio_floor} | {_ratio(r, peers.get('fsdp2'))} "
                f"| {_ratio(r, peers.get('torchao'))} | {_ratio(r, full)} "
            )
            pred = f"{r['pred_step_ms']:.0f} ms / {r['pred_peak_gib']:.2f} GiB"
            host = r.get("host_step_ms_in_loop")
            cyc = r.get("host_cycle")
            cycle = (
                "-"
                if not cyc
                else " / ".join(
                    f"{cyc[k]:.0f}"
                    for k in (
                        "busy_ms",
                        "idle_inside_ms",
                        "idle_after_last_ms",
                        "idle_before_first_ms",
                    )
                )
                + " ms"
            )
            lines.append(
                f"| {w} | {kind} | {_cell(r)} | {pred} {ratios}"
                f"| {'-' if host is None else f'{host:.0f} ms'} | {r.get('host_threads', '-')} "
                f"| {r.get('undone_steps', '-')} | {r.get('speculated_regions', '-')} "
                f"| {cycle} |"
            )
    return "\n".join(lines) + "\n"


def _meta(argv: list[str]) -> dict[str, str]:
    import torch

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
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "gpu": gpu,
        "torch": torch.__version__,
        "command": " ".join(["python", "benchmarks/offload_bench.py", *argv]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=int, default=600)
    parser.add_argument("--json", default="", help="write all results to this JSON file")
    parser.add_argument("--append", default="", help="append a markdown table to this file")
    parser.add_argument(
        "--profile-dir",
        default="",
        help="write a torch.profiler summary and trace of two steps of each 'ours' and "
        "'full_gpu' row here",
    )
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 5:
        parser.error("--steps must be at least 5 (the step time is the mean of the 5 fastest)")
    if args.child:
        child_main(args)
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [w for w in workloads if w not in WORKLOADS] + [k for k in kinds if k not in KINDS]
    if bad:
        parser.error(f"unknown workloads/kinds {bad}; known: {list(WORKLOADS)} {list(KINDS)}")
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for w in workloads:
        results[w] = {}
        for k in kinds:
            print(f"[bench] {w} {k} ...", file=sys.stderr, flush=True)
            results[w][k] = r = run_child(w, k, args)
            print(f"[bench] {w} {k}: {json.dumps(r)}", file=sys.stderr, flush=True)
    meta = _meta(sys.argv[1:] if argv is None else argv)
    table = markdown(results, meta)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.append:
        with Path(args.append).open("a", encoding="utf-8") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
