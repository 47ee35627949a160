"""Issue #7's targets, met or missed, from ``offload_bench.py --json`` files.

    python benchmarks/targets.py benchmarks/results/s31c*.json
    python benchmarks/targets.py --kind ours_io_spec1_stream --kind ours \\
        --kind ours_io_bf16m_spec1_stream "$OUT"/r/*.json

Every ratio sets a row of ours beside a peer or a floor measured in the same run: the
peer's row in the same file (one ``offload_bench.py`` run, as ``pair_ratios.py`` pairs
rounds), else in the same call. Files named ``sNNcM_*`` (``benchmarks/results``) belong
to call M of session NN, and any other file to the call of its folder (one
``gpu_session.sh`` output folder). Where there is more than one row of a peer, the ratio
is taken to the peer's median. A peer's row counts only where it ran the same MLP
activation as ours (:func:`same_model`: BENCH_FUSE_GELU fuses GPT-2's GELU in ours and
the peers alike from session 37 on); rows whose peers ran the other one are listed, left
out of the ratios. Step times are the
issue's measure, the mean of the 5 fastest timed steps; the run mean's ratio follows in
brackets.

The targets (issue #7): every peak allocated within its budget; predicted peak within 5%
of the measured; predicted step within 15% of the run mean; W1 at most 1.05x full-GPU
training (also judged, where rows have them, by the steps that ``BENCH_PAIR_FULL_GPU``
takes in turn with full-GPU training in one process); W2, W3 and W4 with fp32 optimizer
state at most 1.15x the issue's floor and at most 0.55x FSDP2 CPU offload's step; W3
faster than torchao's CPU offload, whose peak fits the 40 GiB budget; W4 with bf16 host
moments (``bf16m`` kinds) faster than torchao. The floor is
:func:`offload_bench.issue_floor`'s; where some rows of a workload had full-GPU training
in their call and others did not, the others' floors lack its compute part (a lower
bound) and they are listed as left out (from session 38 on). Each floor cell names the
part that sets it; where a host part sets some W3 row's floor over full GPU's compute, a
line of its own judges W3's rows against the compute part alone (from session 44 on: that
session's host set W3's floor at 336.8 ms, compute 210.7). A ratio target reads "met"
when every row meets it, "met by the median" when the median row does, else "missed" with
the median's distance from the target. Nothing is allocated; no GPU is needed.

Full-GPU training, for the W1 ratio and the floor's compute part, is a call's
``full_gpu_master`` rows (fp32 master weights and Adam state, from session 40 on), else its
``full_gpu`` rows (fp16 state), in each case only rows that did not diverge
(``offload_bench.trained``: their loss rose or went to nan). Where a call ran torch amp
(``full_gpu_amp``), or fp16 state beside fp32 masters or diverged, those are judged in
lines of their own ("by torch amp", "by fp16 weights and state"), and a last line says
whether each full-GPU row trained.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import (
    OURS_KINDS,
    REFERENCE_FULL_GPU,
    WORKLOADS,
    floor_host_gparam,
    floor_parts,
    fused_rate_in_process_gparam,
    issue_floor,
    reference_full_gpu_kind,
    trained,
)

GiB = 2**30
PEERS = ("full_gpu", "full_gpu_amp", "full_gpu_master", "fsdp2", "torchao")
AMP = "full_gpu_amp"
"""Full-GPU training by torch's mixed-precision recipe (session 39 on): judged in lines of
its own, only where a call ran it."""
FP16 = "full_gpu"
"""Full-GPU training with fp16 weights and state: the targets' full GPU until session 40,
where a call has no ``full_gpu_master``; its weights diverge (peer_training.py), so where
a call has both it is judged in lines of its own."""
EXTRA_FULL_GPU = {AMP: "by torch amp", FP16: "by fp16 weights and state"}
AS_WRITTEN = "gelu_new"
FUSED = "gelu_pytorch_tanh"
PAIRED_W1 = "W1 <= 1.05x full GPU, stepped in turn in one process"
COMPUTE_PART = "full GPU's forward and backward (the floor's compute part alone)"
_CALL = re.compile(r"^(s\d+c\d+)_")
_SESSION = re.compile(r"^(s\d+)c\d+$")


@dataclass(frozen=True)
class Row:
    """One of our rows, with what its call measured beside it."""

    file: str
    workload: str
    kind: str
    result: dict[str, Any]
    peers: dict[str, list[dict[str, Any]]]
    """Each peer kind's rows of the same workload that ran the same MLP activation
    (:func:`same_model`): in the same file where it has them, else in the same call."""
    other_model: tuple[str, ...] = ()
    """The peer kinds of its call left out because they ran the other activation."""
    peer_files: dict[int, str] = field(default_factory=dict)
    """The file each peer row (by ``id``) came from."""
    profile_host_gparam: float | None = None
    """The median of torch's fused host Adam rate as each process read it
    (:func:`offload_bench.fused_rate_in_process_gparam`) over the session's rows that
    planned with the same cached profile, or with one that profiled it again or that it
    replaced (one machine: :func:`_reprofiled_from`), for the floor's host parts where
    it is faster than that profile's reading (:func:`offload_bench.floor_parts`). The median of
    a machine's readings, not one call's: one call of session 36 read 7.1-7.3 Gparam/s in
    process where the machine's other calls read 4.0-5.5 and its profile 4.04."""

    @property
    def label(self) -> str:
        return f"{self.file.removesuffix('.json')} {self.kind}"


@dataclass(frozen=True)
class Verdict:
    target: str
    cells: list[str]
    status: str


def ours_activation(result: dict[str, Any]) -> str:
    """The MLP activation a row of ours ran: GPT-2's tanh GELU as one ``aten.gelu``
    (what transformers calls ``gelu_pytorch_tanh``) when it traced with ``fuse_gelu``, else
    as written (``gelu_new``)."""
    return FUSED if result.get("fuse_gelu") else AS_WRITTEN


def peer_activation(result: dict[str, Any]) -> str:
    """The activation a peer's row (or a row's ``paired_full_gpu``) ran: its record, and
    GPT-2's own for rows from before the peers recorded it (session 37)."""
    return str(result.get("activation", AS_WRITTEN))


def same_model(ours: dict[str, Any], peer: dict[str, Any]) -> bool:
    """Whether ``ours`` and ``peer`` ran the same operations: a ratio between a fused and a
    written-out GELU would credit ours with a model change (BENCH_FUSE_GELU)."""
    return ours_activation(ours) == peer_activation(peer)


def prefer_scaled(peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of a peer kind's rows, those that scaled their loss (``grad_scaler``: full-GPU
    training from session 39 on) where any did: ours scales its loss, and unscaled fp16
    gradients underflow (offload_bench.py's ``full_gpu``). Else all of them: before session
    39 no full-GPU row scaled, and the recorded verdicts are against those."""
    scaled = [r for r in peers if r.get("grad_scaler")]
    return scaled or peers


def call_of(path: Path) -> str:
    """The call a results file belongs to: ``sNNcM`` from its name, else its folder."""
    m = _CALL.match(path.name)
    return m.group(1) if m else str(path.resolve().parent)


def own_budget(workload: str, result: dict[str, Any]) -> bool:
    """Whether a row of ours planned under ``workload``'s own budget: rows under another
    (BENCH_BUDGET_GIB, a diagnostic) answer no target. Rows before session 39 record none."""
    budget = result.get("budget_gib")
    return budget is None or float(budget) == float(WORKLOADS[workload][3])


Machine = tuple[str, float]
"""A machine as :func:`_machine` names it: a session (or a call's folder) and the host
Adam rate of the profile its rows planned with (Gparam/s)."""


def _machine(call: str, result: dict[str, Any]) -> Machine:
    """Which machine a row ran on, as far as its file says: its session (``sNN`` of a
    ``sNNcM`` call; a call named by its folder is its own) and the host Adam rate of the
    profile it planned with (cached once a machine)."""
    m = _SESSION.match(call)
    return m.group(1) if m else call, float(result.get("profile_host_adam_gparam") or 0.0)


def _reprofiled_from(call: str, result: dict[str, Any]) -> Machine | None:
    """The machine (:func:`_machine`'s key) a row found cached before it profiled the
    machine again (its ``reprofiled``), else None: the same machine as the row's own key,
    under the profile it replaced. Session 53's call 3 profiled again between two W2 rows
    (cached 4.41 Gparam/s, again 4.86) and, keyed by the profile alone, the second row's
    floor took its process's one reading (6.72) where the machine's three read 4.35-6.72."""
    again = result.get("reprofiled")
    if not isinstance(again, dict) or "cached_gparam" not in again:
        return None
    return _machine(call, result)[0], float(again["cached_gparam"])


def _machines(
    links: list[tuple[Machine, Machine]],
) -> Callable[[Machine], Machine]:
    """The machine of a :func:`_machine` key, where ``links`` join keys that are one machine
    (a profile and the one that replaced it): each group's first key in sorted order."""
    parent: dict[Machine, Machine] = {}

    def find(key: Machine) -> Machine:
        while parent.get(key, key) != key:
            key = parent[key]
        return key

    for a, b in links:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return find


def load_rows(paths: list[Path], kinds: set[str] | None = None) -> list[Row]:
    """Our successful rows in ``paths`` under their workload's own budget (of ``kinds``
    when given; never the ablation), each with its call's peer rows of the same workload."""
    in_call: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    in_file: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    ours: list[tuple[str, str, str, str, dict[str, Any]]] = []
    peer_files: dict[int, str] = {}
    fused_reads: dict[Machine, list[float]] = {}  # by session and profile
    links: list[tuple[Machine, Machine]] = []  # profiled again
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):  # not an offload_bench.py file (ring_rate.py's, say)
            continue
        call = call_of(path)
        for workload, by_kind in data.get("results", {}).items():
            for kind, result in by_kind.items():
                if not result.get("ok"):
                    continue
                at = _machine(call, result)
                replaced = _reprofiled_from(call, result)
                if replaced is not None:
                    links.append((replaced, at))
                fused = fused_rate_in_process_gparam(result)
                if fused is not None:
                    fused_reads.setdefault(at, []).append(fused)
                if kind in PEERS:
                    peer_files[id(result)] = path.name
                    for table, key in ((in_call, call), (in_file, str(path.resolve()))):
                        table.setdefault((key, workload), {}).setdefault(kind, []).append(result)
                elif (
                    kind in OURS_KINDS
                    and kind != "ablation"
                    and (kinds is None or kind in kinds)
                    and own_budget(workload, result)
                ):
                    ours.append((call, str(path.resolve()), workload, kind, result))
    machine = _machines(links)
    reads_by_machine: dict[Machine, list[float]] = {}
    for where, read in fused_reads.items():
        reads_by_machine.setdefault(machine(where), []).extend(read)
    rows = []
    for call, file, w, kind, result in ours:
        by_call = in_call.get((call, w), {})
        by_file = in_file.get((file, w), {})
        peers = {}
        for peer in by_call:
            # The same run's peer where it ran the same model, else the call's.
            for results in (by_file.get(peer, []), by_call[peer]):
                same = prefer_scaled([r for r in results if same_model(result, r)])
                if same:
                    peers[peer] = same
                    break
        other = tuple(sorted(set(by_call) - set(peers)))
        reads = reads_by_machine.get(machine(_machine(call, result)))
        host = statistics.median(reads) if reads else None
        rows.append(Row(Path(file).name, w, kind, result, peers, other, peer_files, host))
    return rows


def _peer(row: Row, kind: str) -> tuple[float, float | None] | None:
    """The median step of ``kind``'s rows in ``row``'s call, and of their run means
    (those that did not diverge, where ``kind`` is its full GPU: :func:`_trained_peers`)."""
    rows = _trained_peers(row, kind)
    if not rows:
        return None
    means = [r["step_mean_ms"] for r in rows if "step_mean_ms" in r]
    return (
        statistics.median(r["step_ms"] for r in rows),
        statistics.median(means) if len(means) == len(rows) else None,
    )


def _ratio_cell(row: Row, ratio: float, run_ratio: float | None) -> str:
    run = "" if run_ratio is None else f" (run {run_ratio:.3f}x)"
    return f"{row.label}: {ratio:.3f}x{run}"


def _floor_end(parts: dict[str, float], key: str, row: Row | None = None) -> str:
    """What a row's floor is (its :func:`offload_bench.floor_parts`, ``key`` the part that
    sets it): that part and beside it full GPU's compute (or, where that sets it, the next
    largest part), so that a floor set by the host (a slow host's Adam rate) is not read
    as the GPU's; and, where the host parts were taken at the rate ``row``'s call read
    rather than its profile's (the faster of the two: :func:`offload_bench.floor_host_gparam`),
    both rates."""
    if key != "gpu_compute" and "gpu_compute" in parts:
        other = ["gpu_compute"]
    else:
        other = sorted((k for k in parts if k != key), key=lambda k: -parts[k])[:1]
    end = f" of {key} {parts[key]:.1f} ms" + "".join(f" ({k} {parts[k]:.1f})" for k in other)
    host = None if row is None else floor_host_gparam(row.result, row.profile_host_gparam)
    if row is not None and host is not None:
        end += (
            f"; host parts at {host:.2f} Gparam/s, the fused host Adam rate "
            f"its machine's processes read (the profile read "
            f"{row.result['profile_host_adam_gparam']:.2f})"
        )
    return end


def ratio_verdict(
    target: str,
    limit: float,
    ratios: list[tuple[Row, float, float | None]],
    strict: bool,
    suffixes: list[str] | None = None,
) -> Verdict:
    """``target`` over ``ratios`` (row, ratio by the 5 fastest, ratio by run means): met
    when each ratio is within ``limit`` (below it, with ``strict``). ``suffixes``, one a
    ratio, end their rows' cells (what a floor ratio was taken of)."""
    if not ratios:
        return Verdict(target, ["no rows"], "not measured")

    def ok(x: float) -> bool:
        return x < limit if strict else x <= limit

    ends = suffixes if suffixes is not None else [""] * len(ratios)
    cells = [
        _ratio_cell(row, r, run) + end for (row, r, run), end in zip(ratios, ends, strict=True)
    ]
    values = [r for _, r, _ in ratios]
    median = statistics.median(values)
    if all(ok(v) for v in values):
        status = "met"
    elif ok(median):
        status = f"met by the median ({median:.3f}x; {sum(map(ok, values))} of {len(values)} rows)"
    else:
        status = f"missed: median {median:.3f}x, {100 * (median / limit - 1):.1f}% over {limit}x"
    return Verdict(target, cells, status)


def bound_verdict(target: str, checks: list[tuple[str, str, bool]]) -> Verdict:
    """``target`` met when every check holds; ``checks`` are (row label, figure, holds)."""
    if not checks:
        return Verdict(target, ["no rows"], "not measured")
    cells = [f"{label}: {figure}" for label, figure, _ in checks]
    failed = sum(not holds for _, _, holds in checks)
    status = "met" if not failed else f"missed by {failed} of {len(checks)} rows"
    return Verdict(target, cells, status)


def _fp32_state(row: Row) -> bool:
    return "bf16m" not in row.kind and row.kind != "ours_bf16"


def verdicts(rows: list[Row]) -> list[Verdict]:
    """Every target of the issue over ``rows``."""
    out: list[Verdict] = []
    peaks = []
    for row in rows:
        budget = WORKLOADS[row.workload][3]
        peak = row.result["peak_alloc_gib"]
        peaks.append((row.label, f"{peak:.2f} / {budget} GiB", peak <= budget))
    out.append(bound_verdict("peak allocated <= budget", peaks))
    pred_peak, pred_step = [], []
    for row in rows:
        r = row.result
        if "pred_peak_gib" in r:
            err = r["pred_peak_gib"] / r["peak_alloc_gib"] - 1
            pred_peak.append((row.label, f"{100 * err:+.1f}%", abs(err) <= 0.05))
        if "pred_step_ms" in r and "step_mean_ms" in r:
            err = r["pred_step_ms"] / r["step_mean_ms"] - 1
            pred_step.append((row.label, f"{100 * err:+.1f}%", abs(err) <= 0.15))
    out.append(bound_verdict("predicted peak within 5%", pred_peak))
    out.append(bound_verdict("predicted step within 15% of the run mean", pred_step))

    def against(kind: str | None, which: list[Row]) -> list[tuple[Row, float, float | None]]:
        """Each row's ratios to ``kind`` (None: its full-GPU kind, :func:`full_gpu_kind`)."""
        ratios = []
        for row in which:
            k = full_gpu_kind(row) if kind is None else kind
            peer = None if k is None else _peer(row, k)
            if peer is None:
                continue
            step, mean = peer
            own_mean = row.result.get("step_mean_ms")
            run = None if mean is None or own_mean is None else own_mean / mean
            ratios.append((row, row.result["step_ms"] / step, run))
        return ratios

    w1 = [r for r in rows if r.workload == "W1"]
    out.append(ratio_verdict("W1 <= 1.05x full GPU", 1.05, against(None, w1), False))
    # Rows measured with BENCH_PAIR_FULL_GPU: full-GPU training stepped in turn with ours
    # in one process (offload_bench.interleaved_steps), so both saw the same host.
    paired = [
        (row, p["ratio"], p.get("run_ratio"))
        for row in w1
        if isinstance(p := row.result.get("paired_full_gpu"), dict)
        and "ratio" in p
        and same_model(row.result, p)
    ]
    out.append(ratio_verdict(PAIRED_W1, 1.05, paired, False))
    for kind, how in EXTRA_FULL_GPU.items():
        # Only rows whose own full GPU is another kind (FP16 is, without a master row).
        extra = [r for r in w1 if kind in r.peers and full_gpu_kind(r) != kind]
        if extra:
            out.append(
                ratio_verdict(f"W1 <= 1.05x full GPU {how}", 1.05, against(kind, extra), False)
            )
    for w in ("W2", "W3", "W4"):
        fp32 = [r for r in rows if r.workload == w and _fp32_state(r)]
        floors: list[tuple[Row, float, float | None]] = []
        partial: list[tuple[Row, float, float | None]] = []
        floor_ends: list[str] = []
        partial_ends: list[str] = []
        # The rows against the floor's compute part alone, and whether a host or copy part
        # set some whole floor over it.
        compute: list[tuple[Row, float, float | None]] = []
        compute_exceeded = False
        for row in fp32:
            ref = full_gpu_kind(row)
            full = None if ref is None else _peer_row(row, ref)
            floor = issue_floor(row.result, full, row.profile_host_gparam)
            if floor is not None:
                mean = row.result.get("step_mean_ms")
                run = None if mean is None else mean / floor[0]
                ratio = (row, row.result["step_ms"] / floor[0], run)
                whole = full is not None and full.get("ok")
                (floors if whole else partial).append(ratio)
                parts = floor_parts(row.result, full, row.profile_host_gparam)
                (floor_ends if whole else partial_ends).append(_floor_end(parts, floor[1], row))
                if whole and parts.get("gpu_compute"):
                    bound = parts["gpu_compute"]
                    own = None if mean is None else mean / bound
                    compute.append((row, row.result["step_ms"] / bound, own))
                    compute_exceeded |= floor[1] != "gpu_compute"
        # A floor without full-GPU training's compute is a lower bound: such rows are
        # judged only where no row of the workload had the whole floor.
        verdict = ratio_verdict(
            f"{w} fp32 state <= 1.15x floor",
            1.15,
            floors or partial,
            False,
            floor_ends if floors else partial_ends,
        )
        if floors and partial:
            verdict.cells.append(
                "left out, no full GPU that trained in their call: "
                + ", ".join(f"{row.label} {r:.3f}x" for row, r, _ in partial)
            )
        out.append(verdict)
        # W3's floor's compute part alone, where full GPU ran and a host part set some
        # row's floor over it: a host slow enough does (session 44: 336.8 ms against
        # 210.7), and this line keeps the GPU's bound in view. (W2's and W4's budgets
        # leave no plan near full GPU's compute: their floors are their copies and host.)
        if w == "W3" and compute_exceeded:
            out.append(
                ratio_verdict(f"{w} fp32 state <= 1.15x {COMPUTE_PART}", 1.15, compute, False)
            )
        for kind, how in EXTRA_FULL_GPU.items():
            extra_floors: list[tuple[Row, float, float | None]] = [
                (row, row.result["step_ms"] / f[0], None)
                for row in fp32
                if full_gpu_kind(row) != kind
                and (peer := _peer_row(row, kind)) is not None
                and (f := issue_floor(row.result, peer, row.profile_host_gparam)) is not None
            ]
            if extra_floors:
                out.append(
                    ratio_verdict(f"{w} fp32 state <= 1.15x floor {how}", 1.15, extra_floors, False)
                )
        out.append(
            ratio_verdict(f"{w} fp32 state <= 0.55x FSDP2", 0.55, against("fsdp2", fp32), False)
        )
    w3 = [r for r in rows if r.workload == "W3" and _fp32_state(r)]
    out.append(ratio_verdict("W3 faster than torchao", 1.0, against("torchao", w3), True))
    # Each torchao W3 row once, however many of our rows share its call.
    torchao_w3 = {
        id(t): t for row in rows if row.workload == "W3" for t in row.peers.get("torchao", [])
    }
    fits = [
        ("torchao", f"{t['peak_alloc_gib']:.2f} GiB", t["peak_alloc_gib"] <= 40)
        for t in torchao_w3.values()
    ]
    out.append(bound_verdict("torchao's W3 peak fits 40 GiB", fits))
    w4m = [r for r in rows if r.workload == "W4" and "bf16m" in r.kind]
    out.append(
        ratio_verdict("W4 bf16 moments faster than torchao", 1.0, against("torchao", w4m), True)
    )
    # Whether each full-GPU row its call timed trained (each row once).
    full_rows = {
        id(p): (
            f"{row.peer_files.get(id(p), row.file).removesuffix('.json')} {row.workload} {kind}",
            p,
        )
        for row in rows
        for kind in (*REFERENCE_FULL_GPU, AMP)
        for p in row.peers.get(kind, [])
    }
    checks = [
        (label, f"loss {p['loss_before']:.3f} -> {p['loss_after']:.3f}", ok)
        for label, p in full_rows.values()
        if (ok := trained(p)) is not None
    ]
    if checks:
        out.append(bound_verdict("full-GPU rows trained (loss fell, finite)", checks))
    unmatched = [
        f"{row.label} ({ours_activation(row.result)}): {', '.join(row.other_model)}"
        for row in rows
        if row.other_model
        or (
            isinstance(p := row.result.get("paired_full_gpu"), dict)
            and "ratio" in p
            and not same_model(row.result, p)
        )
    ]
    if unmatched:
        out.append(Verdict("peers of another MLP activation", unmatched, "left out of the ratios"))
    return out


def full_gpu_kind(row: Row) -> str | None:
    """The full-GPU kind ``row``'s W1 ratio and floor take: the first of
    ``offload_bench.REFERENCE_FULL_GPU`` its call ran (fp32 masters, from session 40 on;
    else fp16 weights and state) with a row that did not diverge (``trained`` not False;
    rows before session 39 record no loss and count)."""
    return reference_full_gpu_kind(row.peers)


def _trained_peers(row: Row, kind: str) -> list[dict[str, Any]]:
    """``kind``'s rows in ``row``'s call that did not diverge where ``kind`` is its full
    GPU (:func:`full_gpu_kind`); all of them otherwise."""
    rows = row.peers.get(kind, [])
    if kind != full_gpu_kind(row):
        return rows
    return [p for p in rows if trained(p) is not False]


def _peer_row(row: Row, kind: str) -> dict[str, Any] | None:
    """The first of ``kind``'s rows in ``row``'s call (full-GPU training's forward and
    backward time sets the floor's compute part; :func:`_trained_peers`)."""
    rows = _trained_peers(row, kind)
    return rows[0] if rows else None


def markdown(results: list[Verdict]) -> str:
    lines = ["| target | rows (same-call ratios) | status |", "|---|---|---|"]
    for v in results:
        lines.append(f"| {v.target} | {'<br>'.join(v.cells)} | {v.status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, nargs="+", help="offload_bench.py --json files")
    parser.add_argument(
        "--kind",
        action="append",
        metavar="KIND",
        help="only our rows of this kind (may be repeated); default: every kind of ours "
        "but the ablation",
    )
    args = parser.parse_args(argv)
    missing = [p for p in args.json if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(map(str, missing))}")
    unknown = set(args.kind or ()) - set(OURS_KINDS)
    if unknown:
        parser.error(f"unknown kind(s) {sorted(unknown)}; ours are {', '.join(OURS_KINDS)}")
    rows = load_rows(args.json, set(args.kind) if args.kind else None)
    if not rows:
        parser.error("no successful row of ours in these files")
    print(markdown(verdicts(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
