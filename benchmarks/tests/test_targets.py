"""benchmarks/targets.py: the issue's targets from offload_bench.py JSON, on recorded H200
results (BENCHMARKS.md, sessions 32-35) and on small made-up files whose verdicts are known."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import offload_bench
import pytest
import targets
from host_step_contention import ADAM_BYTES_PER_PARAM, memory_rates

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _status(verdicts: list[targets.Verdict], target: str) -> str:
    (found,) = [v for v in verdicts if v.target == target]
    return found.status


W3_PEERS_AND_W4_NOT_RUN = {
    target: "not measured"
    for target in (
        "W3 fp32 state <= 0.55x FSDP2",
        "W4 fp32 state <= 1.15x floor",
        "W4 fp32 state <= 0.55x FSDP2",
        "W3 faster than torchao",
        "torchao's W3 peak fits 40 GiB",
        "W4 bf16 moments faster than torchao",
    )
}
"""The verdicts of a session that ran W3 beside neither FSDP2 nor torchao, and no W4."""

RECORDED = {
    "s32": {
        "predicted step within 15% of the run mean": "missed by 1 of 11 rows",
        # From session 48 on a floor's host parts are at the faster of the profile's
        # fused host Adam rate and its machine's processes' (offload_bench.floor_host_gparam):
        # the profile read 3.79 Gparam/s and the processes 4.53, so W3's floor (its
        # host part) went from 375.9 ms ("met") to 315.0.
        "W3 fp32 state <= 1.15x floor": "missed: median 1.305x, 13.5% over 1.15x",
        "W1 <= 1.05x full GPU": "met by the median (0.895x; 2 of 3 rows)",
        "W2 fp32 state <= 0.55x FSDP2": "missed: median 0.589x, 7.1% over 0.55x",
        "W4 bf16 moments faster than torchao": "met by the median (0.988x; 1 of 2 rows)",
    },
    "s33": {
        "predicted step within 15% of the run mean": "missed by 3 of 11 rows",
        "W2 fp32 state <= 0.55x FSDP2": "met by the median (0.508x; 3 of 4 rows)",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.198x, 4.2% over 1.15x",
        "W4 bf16 moments faster than torchao": "met by the median (0.958x; 1 of 2 rows)",
    },
    "s34": {
        "predicted step within 15% of the run mean": "missed by 5 of 13 rows",
        "W1 <= 1.05x full GPU": "met by the median (0.931x; 3 of 5 rows)",
        "W2 fp32 state <= 0.55x FSDP2": "missed: median 0.567x, 3.1% over 0.55x",
        # From session 48 on a floor's host parts are at the faster of the profile's
        # fused host Adam rate and its machine's processes' (offload_bench.floor_host_gparam):
        # 3.74 and 4.48 here ("met by the median (1.103x; 2 of 3 rows)" before).
        "W3 fp32 state <= 1.15x floor": "missed: median 1.322x, 14.9% over 1.15x",
        "W4 fp32 state <= 1.15x floor": "not measured",
        "W4 fp32 state <= 0.55x FSDP2": "not measured",
    },
    "s35": {
        "predicted step within 15% of the run mean": "missed by 2 of 10 rows",
        "W1 <= 1.05x full GPU": "missed: median 1.096x, 4.4% over 1.05x",
        "W2 fp32 state <= 0.55x FSDP2": "missed: median 0.599x, 8.9% over 0.55x",
        # Host parts at the faster rate from session 48 on: the profile read 3.77, the
        # processes 4.12; W3's floor went from 377.9 ms ("met") to 345.8.
        "W3 fp32 state <= 1.15x floor": "missed: median 1.201x, 4.4% over 1.15x",
    },
    "s36": {
        "predicted step within 15% of the run mean": "missed by 4 of 11 rows",
        "W1 <= 1.05x full GPU": "met by the median (1.033x; 2 of 3 rows)",
        targets.PAIRED_W1: "met by the median (1.029x; 2 of 3 rows)",
        # Host parts at the faster rate from session 48 on: the profile read 4.04, the
        # processes 5.26 by the median; W2's floor went from 366.3 ms to 281.1 and W3's
        # from 353.3 to 271.0 (both "met" before).
        "W2 fp32 state <= 1.15x floor": "missed: median 1.386x, 20.5% over 1.15x",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.392x, 21.1% over 1.15x",
    },
    "s37": {
        "predicted step within 15% of the run mean": "missed by 1 of 9 rows",
        targets.PAIRED_W1: "met",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.316x, 14.5% over 1.15x",
        "W4 fp32 state <= 0.55x FSDP2": "not measured",
        # Call 2 (6c6ac53) ran W1 fused beside full-GPU training as written.
        "peers of another MLP activation": "left out of the ratios",
    },
    "s38": {
        "predicted step within 15% of the run mean": "missed by 5 of 10 rows",
        "W1 <= 1.05x full GPU": "missed: median 1.121x, 6.7% over 1.05x",
        targets.PAIRED_W1: "met",
        "W2 fp32 state <= 1.15x floor": "not measured",
        "W2 fp32 state <= 0.55x FSDP2": "not measured",
        # Call 3's rows; calls 5 and 7 ran W3 without full-GPU training (left out).
        "W3 fp32 state <= 1.15x floor": "missed: median 1.301x, 13.1% over 1.15x",
        "W3 fp32 state <= 0.55x FSDP2": "not measured",
        "W3 faster than torchao": "not measured",
        "torchao's W3 peak fits 40 GiB": "not measured",
        "W4 bf16 moments faster than torchao": "not measured",
    },
    "s39": {
        "predicted step within 15% of the run mean": "missed by 1 of 10 rows",
        # Call 4 beside full GPU unscaled, call 5 beside it scaled (each call's own).
        "W1 <= 1.05x full GPU": "missed: median 1.190x, 13.3% over 1.05x",
        targets.PAIRED_W1: "met by the median (1.025x; 1 of 2 rows)",
        "W2 fp32 state <= 0.55x FSDP2": "met by the median (0.542x; 1 of 2 rows)",
        # Call 1's W3_res row (planned at 120 GiB, nothing offloaded) is left out.
        "W3 fp32 state <= 1.15x floor": "missed: median 1.274x, 10.8% over 1.15x",
        "W4 fp32 state <= 1.15x floor": "not measured",
        "W4 fp32 state <= 0.55x FSDP2": "not measured",
    },
    "s40": {
        "predicted step within 15% of the run mean": "missed by 3 of 8 rows",
        # Beside full GPU with fp32 masters (calls 2, 4, 5); call 1's fp16 row diverged.
        "W1 <= 1.05x full GPU": "missed: median 1.299x, 23.7% over 1.05x",
        targets.PAIRED_W1: "met",
        "W1 <= 1.05x full GPU by torch amp": "met",
        "W1 <= 1.05x full GPU by fp16 weights and state": "missed: median 1.267x, 20.6% over 1.05x",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.210x, 5.2% over 1.15x",
        "W3 fp32 state <= 1.15x floor by torch amp": "met",
        "W3 fp32 state <= 1.15x floor by fp16 weights and state": (
            "missed: median 1.311x, 14.0% over 1.15x"
        ),
        **W3_PEERS_AND_W4_NOT_RUN,
        # Call 1's fp16 rows: W1's loss rose to 21.8, W3's went to nan.
        "full-GPU rows trained (loss fell, finite)": "missed by 2 of 11 rows",
    },
    "s41": {
        # W3 only, on one plan per call: speculative steps in the hooks and on their own
        # thread (call 1), then the thread with the ring yielding or not (call 2).
        "W1 <= 1.05x full GPU": "not measured",
        "W2 fp32 state <= 1.15x floor": "not measured",
        "W2 fp32 state <= 0.55x FSDP2": "not measured",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.218x, 5.9% over 1.15x",
        **W3_PEERS_AND_W4_NOT_RUN,
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s42": {
        # W3 planned for the speculation thread and for the hooks (call 1), s37 (call 2),
        # W4 bf16 moments with the speculative steps in the hooks and on the thread
        # (call 3), W2 beside FSDP2 and torchao and W1 in turn (call 4). No W4 fp32 row.
        "predicted step within 15% of the run mean": "missed by 3 of 12 rows",
        targets.PAIRED_W1: "met",
        "W2 fp32 state <= 0.55x FSDP2": "missed: median 0.560x, 1.9% over 0.55x",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.200x, 4.3% over 1.15x",
        "W4 fp32 state <= 1.15x floor": "not measured",
        "W4 fp32 state <= 0.55x FSDP2": "not measured",
        "W4 bf16 moments faster than torchao": "missed: median 1.090x, 9.0% over 1.0x",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s44": {
        # W3 and W2 staged and not (calls 2 and 3), W3 with 14 and 16 host threads (call
        # 4). The profile read the fused host Adam at 1.65 Gparam/s, the processes at
        # 3.8-4.2: the floors' host parts are at their median, 4.10 (session 47 on; before,
        # the profile's rate set W3's floor at 336.8 ms and W2's at 865.3, both "met").
        "W1 <= 1.05x full GPU": "not measured",
        "W2 fp32 state <= 1.15x floor": "missed: median 1.156x, 0.6% over 1.15x",
        "W2 fp32 state <= 0.55x FSDP2": "missed: median 0.575x, 4.6% over 0.55x",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.275x, 10.9% over 1.15x",
        **W3_PEERS_AND_W4_NOT_RUN,
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s46": {
        # Every workload at 03841bd, staging in backward on (W3's off rows on one plan
        # without it). The host's fused Adam ran 4.85 Gparam/s: W3's floor was full GPU's
        # compute, W2's and W4's their host parts.
        "predicted step within 15% of the run mean": "missed by 7 of 10 rows",
        targets.PAIRED_W1: "met",
        "W2 fp32 state <= 1.15x floor": "missed: median 1.242x, 8.0% over 1.15x",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.165x, 1.3% over 1.15x",
        "W4 fp32 state <= 1.15x floor": "missed: median 1.158x, 0.7% over 1.15x",
        "W4 fp32 state <= 0.55x FSDP2": "missed: median 0.586x, 6.5% over 0.55x",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s47": {
        # marginab, attnab, s37, w4fsp and w1p at bb5cabf. The cached profile read the
        # fused host Adam at 1.40 Gparam/s, the processes at 3.55-5.19: the floors' host
        # parts are at their median (4.64), so W3's floor is full GPU's compute (and its
        # rows with the margin, a plan not the default's, are among them) and W4's its
        # host part.
        "predicted step within 15% of the run mean": "missed by 2 of 15 rows",
        "W1 <= 1.05x full GPU": "missed: median 1.217x, 15.9% over 1.05x",
        targets.PAIRED_W1: "met",
        "W2 fp32 state <= 1.15x floor": "not measured",
        "W2 fp32 state <= 0.55x FSDP2": "not measured",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.256x, 9.2% over 1.15x",
        "W4 fp32 state <= 1.15x floor": "missed: median 1.184x, 3.0% over 1.15x",
        "W4 fp32 state <= 0.55x FSDP2": "missed: median 0.551x, 0.1% over 0.55x",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s48": {
        # tests, s37 and w4fsp at ab6b359. The profile read the fused host Adam at 3.30
        # Gparam/s (the median of three reads), the processes at 4.03 by the median: the
        # floors' host parts are at 4.03, so W3's floor is full GPU's compute and W4's its
        # host part (1300.4 ms; 1589.5 at the profile's rate, under the step).
        "W1 <= 1.05x full GPU": "not measured",
        "W2 fp32 state <= 1.15x floor": "not measured",
        "W2 fp32 state <= 0.55x FSDP2": "not measured",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.289x, 12.1% over 1.15x",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s50": {
        # testsq, s37, thrab, w4fsp, w2x + w1p + profreads and rateab at dcb0d65, then
        # call 7's two W3 rows at 490947c (6 and 3 ring slots, no full GPU beside them:
        # out of the floor's verdict). W1's separate full-GPU row stepped 25.9 ms against
        # 32.2 when stepped in turn in ours' process.
        "predicted step within 15% of the run mean": "missed by 1 of 14 rows",
        "W1 <= 1.05x full GPU": "missed: median 1.317x, 25.4% over 1.05x",
        targets.PAIRED_W1: "met",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.196x, 4.0% over 1.15x",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s51": {
        # testsq and streamcap at 3b7f1fd, lateab and s37 at 791cf55 (host work moved to
        # later regions, new). The floor's verdict takes every W3 row beside full GPU:
        # one plan before the change, as planned and capped (call 2, 1.183-1.262x), and the
        # plans after it (calls 3 and 4:
        # 1.117x, 1.121x, 1.245x).
        "W1 <= 1.05x full GPU": "not measured",
        "W2 fp32 state <= 1.15x floor": "not measured",
        "W2 fp32 state <= 0.55x FSDP2": "not measured",
        "W3 fp32 state <= 1.15x floor": "missed: median 1.188x, 3.3% over 1.15x",
        "W4 fp32 state <= 1.15x floor": "not measured",
        "W4 fp32 state <= 0.55x FSDP2": "not measured",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s52": {
        # thrab (14 and 15 host threads), w1p and w2x, then s37, at 90b7f0e; call 3 at
        # 153f8c2 (host Adam threads claiming blocks, new): W2 claimed, equal shares,
        # claimed; its W3 row ran out of device time before full GPU (a log, not a row).
        "predicted step within 15% of the run mean": "missed by 3 of 11 rows",
        "W1 <= 1.05x full GPU": "missed: median 1.087x, 3.5% over 1.05x",
        targets.PAIRED_W1: "met",
        "W2 fp32 state <= 1.15x floor": "missed: median 1.159x, 0.8% over 1.15x",
        "W2 fp32 state <= 0.55x FSDP2": "missed: median 0.552x, 0.4% over 0.55x",
        "W4 fp32 state <= 1.15x floor": "not measured",
        "W4 fp32 state <= 0.55x FSDP2": "not measured",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s53": {
        # claimab on W3 (claimed beside full GPU, then equal shares and claimed in turn),
        # the whole gpu_tests, w4fsp and w2x, w1p, all at 48cf18f. W2's floor is met with
        # the W2_2 row's readings kept with its machine's (_reprofiled_from): keyed by its
        # new profile alone it took one reading (6.72 Gparam/s) and read 1.312x.
        "predicted step within 15% of the run mean": "missed by 4 of 11 rows",
        targets.PAIRED_W1: "met",
        "W3 fp32 state <= 0.55x FSDP2": "not measured",
        "W3 faster than torchao": "not measured",
        "torchao's W3 peak fits 40 GiB": "not measured",
        "W4 bf16 moments faster than torchao": "not measured",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s54": {
        # s37 (W3 beside full GPU, FSDP2 and torchao; W4 bf16 moments beside torchao),
        # w4fsp, w1p, cpuprobe on W2 (beside FSDP2), all at 129887a: every target met but
        # W2's predicted step (-24.1% of its run mean).
        "predicted step within 15% of the run mean": "missed by 1 of 5 rows",
        targets.PAIRED_W1: "met",
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s55": {
        # ringcal on W2 (default beside FSDP2, calibrated by the host, by host and ring),
        # w2x twice, w1p, at 665a14b; then W2 and W1 rows of ours alone with the host's
        # pass spans at 0353bac (W1's rebuilt from its printed row). W3 and W4 not run.
        "predicted step within 15% of the run mean": "missed by 4 of 8 rows",
        "W1 <= 1.05x full GPU": "missed: median 1.060x, 1.0% over 1.05x",
        targets.PAIRED_W1: "met",
        "W2 fp32 state <= 1.15x floor": "met by the median (0.972x; 5 of 6 rows)",
        "W2 fp32 state <= 0.55x FSDP2": "met by the median (0.487x; 4 of 5 rows)",
        "W3 fp32 state <= 1.15x floor": "not measured",
        **W3_PEERS_AND_W4_NOT_RUN,
        "full-GPU rows trained (loss fell, finite)": "met",
    },
    "s56": {
        # bifab at c0093c8: W2 beside FSDP2 and W3 beside full GPU at the defaults of then
        # (factor 1), then each planned at a backward issue factor of 4. W1, W3's other
        # peers and W4 not run (the call for them came back with nothing).
        "W1 <= 1.05x full GPU": "not measured",
        **W3_PEERS_AND_W4_NOT_RUN,
        "full-GPU rows trained (loss fell, finite)": "met",
    },
}
"""Each recorded session's verdicts as BENCHMARKS.md reports them, where not plainly met
(no session before 36 stepped W1 in turn with full-GPU training; session 36 did)."""

RECORDED_ROWS = {
    "s32": 11,
    "s33": 11,
    "s34": 13,
    "s35": 10,
    "s36": 11,
    "s37": 9,
    "s38": 10,
    "s39": 10,
    "s40": 8,
    "s41": 14,
    "s42": 12,
    "s44": 12,
    "s46": 10,
    "s47": 15,
    "s48": 3,
    "s50": 14,
    "s51": 13,
    "s52": 11,
    "s53": 11,
    "s54": 5,
    "s55": 8,
    "s56": 4,
}
"""How many of our rows each recorded session has."""


OPTIONAL = {
    "peers of another MLP activation",
    "W1 <= 1.05x full GPU by torch amp",
    "W1 <= 1.05x full GPU by fp16 weights and state",
    *(
        f"W{n} fp32 state <= 1.15x floor by {how}"
        for n in (2, 3, 4)
        for how in ("torch amp", "fp16 weights and state")
    ),
    "full-GPU rows trained (loss fell, finite)",
    f"W3 fp32 state <= 1.15x {targets.COMPUTE_PART}",
}
"""Verdicts that only some sessions' rows give (each recorded session lists those it has)."""


@pytest.mark.parametrize("session", sorted(RECORDED))
def test_recorded_sessions_verdicts_are_those_benchmarks_md_reports(session: str) -> None:
    # s33c1_host_memory.json is host_step_contention.py's output: load_rows skips it.
    rows = targets.load_rows(sorted(RESULTS.glob(f"{session}c*.json")))
    verdicts = targets.verdicts(rows)
    assert len(rows) == RECORDED_ROWS[session]
    assert len(verdicts) == 14 + len(OPTIONAL & set(RECORDED[session]))
    expected = {targets.PAIRED_W1: "not measured", **RECORDED[session]}
    assert set(expected) <= {v.target for v in verdicts}
    for v in verdicts:
        assert v.status == expected.get(v.target, "met"), v.target


def _row(step: float, mean: float, **extra: Any) -> dict[str, Any]:
    return {"ok": True, "step_ms": step, "step_mean_ms": mean, **extra}


def _ours(step: float, mean: float, **extra: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"peak_alloc_gib": 2.5, "pred_peak_gib": 2.5, "pred_step_ms": mean}
    return _row(step, mean, **{**fields, **extra})


def _write(path: Path, results: dict[str, dict[str, dict[str, Any]]]) -> Path:
    path.write_text(json.dumps({"meta": {}, "results": results}))
    return path


def test_a_peer_in_the_same_file_is_preferred_to_one_in_the_same_call(tmp_path: Path) -> None:
    # Call 1: file a has ours and FSDP2 at 1000 ms; file b has FSDP2 at 500 ms alone.
    a = _write(
        tmp_path / "s99c1_a.json", {"W2": {"ours": _ours(540, 540), "fsdp2": _row(1000, 1000)}}
    )
    b = _write(tmp_path / "s99c1_b.json", {"W2": {"fsdp2": _row(500, 500)}})
    # Call 2: ours alone, so its peer is call 2's, none here.
    c = _write(tmp_path / "s99c2_c.json", {"W2": {"ours": _ours(300, 300)}})
    rows = targets.load_rows([a, b, c])
    assert [r.file for r in rows] == ["s99c1_a.json", "s99c2_c.json"]
    verdict = [v for v in targets.verdicts(rows) if v.target == "W2 fp32 state <= 0.55x FSDP2"]
    assert verdict[0].status == "met"
    assert verdict[0].cells == ["s99c1_a ours: 0.540x (run 0.540x)"]


def test_ours_without_a_peer_in_its_call_takes_the_calls_other_files(tmp_path: Path) -> None:
    a = _write(tmp_path / "s99c1_a.json", {"W2": {"ours": _ours(600, 660)}})
    b = _write(tmp_path / "s99c1_b.json", {"W2": {"fsdp2": _row(1000, 1100)}})
    rows = targets.load_rows([a, b])
    verdict = [v for v in targets.verdicts(rows) if v.target == "W2 fp32 state <= 0.55x FSDP2"]
    assert verdict[0].status == "missed: median 0.600x, 9.1% over 0.55x"
    assert verdict[0].cells == ["s99c1_a ours: 0.600x (run 0.600x)"]


def test_rows_without_full_gpu_in_their_call_are_left_out_of_the_floor(
    tmp_path: Path,
) -> None:
    # Call 1 ran full GPU (forward and backward 200 ms): ours 230 ms, 1.15x. Call 2 did
    # not: its floor is the host Adam's 100 ms alone, a lower bound, and its 2.5x is left
    # out while a row with the whole floor exists; alone, it is judged.
    def w3(step: float) -> dict[str, Any]:
        return {**_ours(step, step), "floor_parts_ms": {"host_adam": 100.0}}

    full = {**_row(210, 210), "fwd_bwd_ms": 200.0}
    a = _write(tmp_path / "s99c1_a.json", {"W3": {"ours": w3(230), "full_gpu": full}})
    b = _write(tmp_path / "s99c2_b.json", {"W3": {"ours": w3(250)}})
    target = "W3 fp32 state <= 1.15x floor"
    (verdict,) = [v for v in targets.verdicts(targets.load_rows([a, b])) if v.target == target]
    assert verdict.status == "met"
    assert verdict.cells == [
        "s99c1_a ours: 1.150x (run 1.150x) of gpu_compute 200.0 ms (host_adam 100.0)",
        "left out, no full GPU that trained in their call: s99c2_b ours 2.500x",
    ]
    (alone,) = [v for v in targets.verdicts(targets.load_rows([b])) if v.target == target]
    assert alone.status == "missed: median 2.500x, 117.4% over 1.15x"
    assert alone.cells == ["s99c2_b ours: 2.500x (run 2.500x) of host_adam 100.0 ms"]


@pytest.mark.parametrize(
    ("rows_glob", "status", "end", "ratios"),
    [
        # Session 32's W3 rows ran without full GPU in their call: the floor is their
        # host-state parameters over the fused host Adam rate, a host part. Their profile
        # read 3.79 Gparam/s (375.9 ms, the rows 1.08-1.11x of it: "met" up to session 48)
        # and their processes 4.33 by the median; a floor takes the faster (328.9 ms).
        (
            "s32c*_W3*.json",
            "missed: median 1.250x, 8.7% over 1.15x",
            " of host_adam_all_host_state 328.9 ms (host_adam 248.2); host parts at 4.33"
            " Gparam/s, the fused host Adam rate its machine's processes read (the profile"
            " read 3.79)",
            ["1.235x (run 1.294x)", "1.264x (run 1.302x)"],
        ),
        # Session 44's profile read the fused fp32 Adam at 1.65 Gparam/s where the
        # processes that planned with it read 3.8-4.2 (session 43's profile, 3.87): a
        # disturbed reading. Up to session 46 it set W3's floor (336.8 ms, the rows
        # 0.78-0.82x of it); with the host parts at the machine's own rate the floor is
        # full GPU's forward and backward (210.7 ms), and each cell says both rates.
        (
            "s44c2_W3_stage_*.json",
            "missed: median 1.265x, 10.0% over 1.15x",
            " of gpu_compute 210.7 ms (host_adam_all_host_state 131.1); host parts at 4.23"
            " Gparam/s, the fused host Adam rate its machine's processes read (the profile"
            " read 1.65)",
            [
                "1.272x (run 1.335x)",
                "1.254x (run 1.338x)",
                "1.248x (run 1.360x)",
                "1.265x (run 1.285x)",
                "1.311x (run 1.374x)",
            ],
        ),
        # Session 45's host stepped it at 4.11 Gparam/s, so W3's floor was full GPU's
        # forward and backward (212.1 ms), its host part (134.9 ms) beside it; the rows
        # staged in backward (on) are faster than those without (off), and the median of
        # all five still misses 1.15x.
        (
            "s45c2_W3_bstage_*.json",
            "missed: median 1.186x, 3.1% over 1.15x",
            " of gpu_compute 212.1 ms (host_adam_all_host_state 134.9)",
            [
                "1.192x (run 1.221x)",
                "1.221x (run 1.264x)",
                "1.186x (run 1.215x)",
                "1.144x (run 1.196x)",
                "1.160x (run 1.236x)",
            ],
        ),
    ],
    ids=["set_by_the_host", "profile_disturbed", "set_by_compute"],
)
def test_a_floor_names_the_part_that_set_it(
    rows_glob: str, status: str, end: str, ratios: list[str]
) -> None:
    paths = sorted(RESULTS.glob(rows_glob))
    (verdict,) = [
        v
        for v in targets.verdicts(targets.load_rows(paths))
        if v.target == "W3 fp32 state <= 1.15x floor"
    ]
    assert verdict.status == status
    assert verdict.cells == [
        f"{path.stem} ours_io_spec1_stream: {ratio}{end}"
        for path, ratio in zip(paths, ratios, strict=True)
    ]


def test_failed_rows_and_the_ablation_are_left_out(tmp_path: Path) -> None:
    a = _write(
        tmp_path / "s99c1_a.json",
        {
            "W2": {
                "ours": {"ok": False, "error": "host out of memory"},
                "ablation": _ours(900, 900),
                "fsdp2": _row(1000, 1000),
            }
        },
    )
    assert targets.load_rows([a]) == []


def test_rows_under_another_budget_answer_no_target(tmp_path: Path) -> None:
    # W3 planned at 120 GiB (BENCH_BUDGET_GIB) peaks over W3's 40: a diagnostic row, not
    # a missed budget; the row under W3's own budget (or recording none) still counts.
    roomy = _ours(200, 210, budget_gib=120.0, peak_alloc_gib=45.0)
    own = _ours(250, 260, budget_gib=40.0)
    older = _ours(255, 265)
    a = _write(tmp_path / "s99c1_a.json", {"W3": {"ours_io_spec1_stream": roomy}})
    b = _write(tmp_path / "s99c1_b.json", {"W3": {"ours_io_spec1_stream": own}})
    c = _write(tmp_path / "s99c1_c.json", {"W3": {"ours_io_spec1_stream": older}})
    rows = targets.load_rows([a, b, c])
    assert [r.result["step_ms"] for r in rows] == [250, 255]
    assert _status(targets.verdicts(rows), "peak allocated <= budget") == "met"
    assert targets.own_budget("W3", {"budget_gib": 40})
    assert not targets.own_budget("W3", {"budget_gib": 120.0})


def test_a_full_gpu_row_that_scaled_its_loss_is_preferred_to_one_that_did_not(
    tmp_path: Path,
) -> None:
    # One call: full GPU unscaled (190 ms) in its own file, then ours beside full GPU scaled
    # (200 ms) in another; and an older call whose only full-GPU row records no scaler.
    unscaled = _row(190, 190, fwd_bwd_ms=180, grad_scaler=False)
    scaled = _row(200, 200, fwd_bwd_ms=190, grad_scaler=True)
    a = _write(tmp_path / "s99c1_a.json", {"W1": {"full_gpu": unscaled}})
    b = _write(tmp_path / "s99c1_b.json", {"W1": {"ours": _ours(205, 205), "full_gpu": scaled}})
    c = _write(tmp_path / "s99c1_c.json", {"W1": {"ours": _ours(195, 195)}})
    old = _write(
        tmp_path / "s98c1_a.json", {"W1": {"ours": _ours(195, 195), "full_gpu": _row(190, 190)}}
    )
    rows = {r.file: r for r in targets.load_rows([a, b, c, old])}
    assert rows["s99c1_b.json"].peers["full_gpu"] == [scaled]
    assert rows["s99c1_c.json"].peers["full_gpu"] == [scaled]  # the call's scaled row
    assert rows["s98c1_a.json"].peers["full_gpu"][0]["step_ms"] == 190
    assert targets.prefer_scaled([unscaled]) == [unscaled]


def test_full_gpu_by_torch_amp_gets_lines_of_its_own_where_a_call_ran_it(
    tmp_path: Path,
) -> None:
    fp16 = _row(40, 40, fwd_bwd_ms=35, grad_scaler=True)
    amp = _row(50, 50, fwd_bwd_ms=44, grad_scaler=True, recipe="amp")
    ours = _ours(42, 42, floor_parts_ms={"h2d": 0.0})
    a = _write(
        tmp_path / "s99c1_a.json", {"W1": {"ours": ours, "full_gpu": fp16, "full_gpu_amp": amp}}
    )
    w3 = _ours(230, 230, floor_parts_ms={"h2d": 50.0})
    b = _write(
        tmp_path / "s99c1_b.json",
        {
            "W3": {
                "ours": w3,
                "full_gpu": _row(205, 205, fwd_bwd_ms=195),
                "full_gpu_amp": amp | {"fwd_bwd_ms": 210},
            }
        },
    )
    verdicts = targets.verdicts(targets.load_rows([a, b]))
    assert _status(verdicts, "W1 <= 1.05x full GPU") == "met"  # 42 / 40
    assert _status(verdicts, "W1 <= 1.05x full GPU by torch amp") == "met"
    assert _status(verdicts, "W3 fp32 state <= 1.15x floor").startswith("missed")  # 230 / 195
    assert _status(verdicts, "W3 fp32 state <= 1.15x floor by torch amp") == "met"  # 230 / 210
    # Without an amp row in the call, no such line.
    c = _write(tmp_path / "s98c1_a.json", {"W1": {"ours": ours, "full_gpu": fp16}})
    assert not any("torch amp" in v.target for v in targets.verdicts(targets.load_rows([c])))


def test_fp32_masters_are_the_full_gpu_where_a_call_ran_them_and_fp16_gets_its_own_lines(
    tmp_path: Path,
) -> None:
    fp16 = _row(40, 40, fwd_bwd_ms=35, grad_scaler=True, loss_before=7.1, loss_after=21.8)
    master = _row(44, 44, fwd_bwd_ms=37, recipe="master", loss_before=7.1, loss_after=1.9)
    ours = _ours(45, 45, floor_parts_ms={"h2d": 0.0})
    a = _write(
        tmp_path / "s99c1_a.json",
        {"W1": {"ours": ours, "full_gpu": fp16, "full_gpu_master": master}},
    )
    w3 = _ours(230, 230, floor_parts_ms={"h2d": 50.0})
    b = _write(
        tmp_path / "s99c1_b.json",
        {
            "W3": {
                "ours": w3,
                "full_gpu": _row(205, 205, fwd_bwd_ms=195, loss_before=7.2, loss_after=math.nan),
                "full_gpu_master": _row(215, 215, fwd_bwd_ms=205),
            }
        },
    )
    rows = targets.load_rows([a, b])
    assert {targets.full_gpu_kind(r) for r in rows} == {"full_gpu_master"}
    verdicts = targets.verdicts(rows)
    assert _status(verdicts, "W1 <= 1.05x full GPU") == "met"  # 45 / 44, not 45 / 40
    assert _status(verdicts, "W1 <= 1.05x full GPU by fp16 weights and state").startswith("missed")
    assert _status(verdicts, "W3 fp32 state <= 1.15x floor") == "met"  # 230 / 205
    assert _status(verdicts, "W3 fp32 state <= 1.15x floor by fp16 weights and state").startswith(
        "missed"
    )  # 230 / 195
    (trained,) = [v for v in verdicts if v.target.startswith("full-GPU rows trained")]
    # The W3 master row records no loss; the fp16 rows rose or went to nan.
    assert len(trained.cells) == 3 and trained.status == "missed by 2 of 3 rows"
    assert any("nan" in c for c in trained.cells)
    # A call without a master row keeps fp16 as its full GPU (recording no loss, as
    # before session 39) and no fp16 line of its own.
    legacy = _row(40, 40, fwd_bwd_ms=35)
    c = _write(tmp_path / "s98c1_a.json", {"W1": {"ours": ours, "full_gpu": legacy}})
    (row,) = targets.load_rows([c])
    assert targets.full_gpu_kind(row) == "full_gpu"
    assert not any("fp16 weights" in v.target for v in targets.verdicts([row]))


def test_a_full_gpu_row_that_diverged_is_no_reference(tmp_path: Path) -> None:
    fp16 = _row(40, 40, fwd_bwd_ms=35, loss_before=7.1, loss_after=21.8)
    ours = _ours(45, 45, floor_parts_ms={"h2d": 0.0})
    a = _write(tmp_path / "s99c1_a.json", {"W1": {"ours": ours, "full_gpu": fp16}})
    (row,) = targets.load_rows([a])
    assert targets.full_gpu_kind(row) is None
    verdicts = targets.verdicts([row])
    assert _status(verdicts, "W1 <= 1.05x full GPU") == "not measured"
    # Judged in its own line, as the targets read before session 40.
    assert _status(verdicts, "W1 <= 1.05x full GPU by fp16 weights and state").startswith("missed")
    assert offload_bench.reference_full_gpu({"full_gpu": fp16}) is None
    master = _row(44, 44, loss_before=7.1, loss_after=2.0)
    assert offload_bench.reference_full_gpu({"full_gpu": fp16, "full_gpu_master": master}) is master
    assert offload_bench.reference_full_gpu({"full_gpu": _row(40, 40)}) is not None  # no loss


def test_a_full_gpu_row_is_named_by_the_file_that_holds_it(tmp_path: Path) -> None:
    # Three files of one call, the peer in the first only: its line names that file,
    # not the call's last row of ours (session 41's targets named s41c1_W3_pin_thread3).
    master = _row(230, 230, fwd_bwd_ms=210, recipe="master", loss_before=7.2, loss_after=6.9)
    files = [
        _write(
            tmp_path / "s99c1_source.json",
            {"W3": {"ours": _ours(250, 250), "full_gpu_master": master}},
        ),
        _write(tmp_path / "s99c1_x1.json", {"W3": {"ours": _ours(251, 251)}}),
        _write(tmp_path / "s99c1_x2.json", {"W3": {"ours": _ours(252, 252)}}),
    ]
    verdicts = targets.verdicts(targets.load_rows(files))
    (trained,) = [v for v in verdicts if v.target.startswith("full-GPU rows trained")]
    assert len(trained.cells) == 1
    assert trained.cells[0].startswith("s99c1_source W3 full_gpu_master")


def test_trained_needs_a_finite_loss_that_fell() -> None:
    assert offload_bench.trained({"loss_before": 7.0, "loss_after": 6.0}) is True
    assert offload_bench.trained({"loss_before": 7.0, "loss_after": 7.5}) is False
    assert offload_bench.trained({"loss_before": 7.0, "loss_after": math.nan}) is False
    assert offload_bench.trained({}) is None


def test_faster_than_is_strict_and_at_most_is_not() -> None:
    row = targets.Row("f.json", "W3", "ours", {}, {})
    assert targets.ratio_verdict("t", 1.0, [(row, 1.0, None)], strict=True).status.startswith(
        "missed"
    )
    assert targets.ratio_verdict("t", 1.0, [(row, 1.0, None)], strict=False).status == "met"
    assert targets.ratio_verdict("t", 1.0, [], strict=False).status == "not measured"


def test_peak_over_budget_and_prediction_off_by_more_than_5_percent_are_missed(
    tmp_path: Path,
) -> None:
    over = _row(300, 300, peak_alloc_gib=3.2, pred_peak_gib=3.0, pred_step_ms=300)
    a = _write(tmp_path / "s99c1_a.json", {"W2": {"ours": over}})
    verdicts = targets.verdicts(targets.load_rows([a]))
    assert _status(verdicts, "peak allocated <= budget") == "missed by 1 of 1 rows"
    assert _status(verdicts, "predicted peak within 5%") == "missed by 1 of 1 rows"
    assert _status(verdicts, "predicted step within 15% of the run mean") == "met"


def test_memory_rates_count_28_bytes_a_parameter_and_add_the_copies() -> None:
    assert ADAM_BYTES_PER_PARAM == 28
    assert memory_rates(4e9, []) == {"adam_gbps": pytest.approx(112.0)}
    assert memory_rates(4e9, [0.0, 0.0]) == {"adam_gbps": pytest.approx(112.0)}
    rates = memory_rates(2.5e9, [40.0, 50.0, 60.0])
    assert rates == {
        "adam_gbps": pytest.approx(70.0),
        "copy_gbps": pytest.approx(50.0),
        "host_memory_gbps": pytest.approx(120.0),
    }


def test_w1_rows_stepped_in_turn_are_judged_by_their_own_pairs(tmp_path: Path) -> None:
    # The separate full-GPU row is faster (1.2x); the pairs taken in one process say 1.02x
    # and 1.04x: the two verdicts are each other's, not mixed.
    paired = {"ratio": 1.02, "run_ratio": 1.01, "pair_ratio_median": 1.0}
    rows = {"ours": _ours(36, 40) | {"paired_full_gpu": paired}, "full_gpu": _row(30, 33)}
    a = _write(tmp_path / "s99c1_a.json", {"W1": rows})
    worse = {"ratio": 1.10, "run_ratio": 1.12}
    b = _write(
        tmp_path / "s99c2_b.json", {"W1": {"ours": _ours(36, 40) | {"paired_full_gpu": worse}}}
    )
    failed = {"error": "the plan has host-state regions"}
    c = _write(
        tmp_path / "s99c3_c.json", {"W1": {"ours": _ours(36, 40) | {"paired_full_gpu": failed}}}
    )
    verdicts = targets.verdicts(targets.load_rows([a, b, c]))
    (separate,) = [v for v in verdicts if v.target == "W1 <= 1.05x full GPU"]
    assert separate.status == "missed: median 1.200x, 14.3% over 1.05x"
    (in_turn,) = [v for v in verdicts if v.target == targets.PAIRED_W1]
    assert in_turn.cells == [
        "s99c1_a ours: 1.020x (run 1.010x)",
        "s99c2_b ours: 1.100x (run 1.120x)",
    ]
    assert in_turn.status == "missed: median 1.060x, 1.0% over 1.05x"


def test_a_fused_gelu_row_is_judged_only_beside_peers_that_ran_the_fused_gelu(
    tmp_path: Path,
) -> None:
    # Call 1: ours fused (BENCH_FUSE_GELU) beside full-GPU training as written (the faster
    # ratio a model change would flatter ours with) and as one aten.gelu; call 2's fused
    # row was paired in turn with full-GPU training as written, so it has no W1 verdict.
    fused = _ours(30, 33) | {"fuse_gelu": True}
    plain_peer = _row(40, 44)
    fused_peer = _row(31, 34, activation=targets.FUSED)
    a = _write(tmp_path / "s99c1_a.json", {"W1": {"ours": fused, "full_gpu": plain_peer}})
    b = _write(tmp_path / "s99c1_b.json", {"W1": {"full_gpu": fused_peer}})
    paired = {"ratio": 0.75, "run_ratio": 0.75}
    c = _write(tmp_path / "s99c2_c.json", {"W1": {"ours": fused | {"paired_full_gpu": paired}}})
    rows = targets.load_rows([a, b, c])
    assert rows[0].peers == {"full_gpu": [fused_peer]}
    assert rows[0].other_model == ()  # call 1 had a fused full-GPU row: nothing left out
    verdicts = targets.verdicts(rows)
    (separate,) = [v for v in verdicts if v.target == "W1 <= 1.05x full GPU"]
    assert separate.cells == ["s99c1_a ours: 0.968x (run 0.971x)"]
    assert _status(verdicts, targets.PAIRED_W1) == "not measured"
    (left,) = [v for v in verdicts if v.target == "peers of another MLP activation"]
    assert left.cells == ["s99c2_c ours (gelu_pytorch_tanh): "]
    # The same rows as written match only the peers as written.
    plain = _write(
        tmp_path / "s99c3_d.json", {"W1": {"ours": _ours(41, 45), "full_gpu": plain_peer}}
    )
    (row,) = targets.load_rows([plain, b])
    assert row.peers == {"full_gpu": [plain_peer]} and row.other_model == ()


def test_a_floors_host_parts_are_taken_at_the_faster_of_the_profile_and_the_machine(
    tmp_path: Path,
) -> None:
    # Both rows planned with a profile that read the fused host Adam at 1 Gparam/s; their
    # processes read it at 3 and 5 (samples times cost), median 4: the faster, so the
    # floor's host part (400 ms at the profile's rate) is 100 ms, and full GPU's compute
    # (200 ms) sets the floor.
    def w3(step: float, sample: float) -> dict[str, Any]:
        return {
            **_ours(step, step),
            "floor_parts_ms": {"host_adam": 400.0, "h2d": 50.0},
            "profile_host_adam_gparam": 1.0,
            "host_rate_samples_gparam": [sample / 2, sample / 2, sample / 2],
            "host_step_cost": 2.0,
        }

    full = {**_row(210, 210), "fwd_bwd_ms": 200.0}
    a = _write(tmp_path / "s99c1_a.json", {"W3": {"ours": w3(220, 3.0), "full_gpu": full}})
    b = _write(tmp_path / "s99c2_b.json", {"W3": {"ours": w3(240, 5.0), "full_gpu": full}})
    assert offload_bench.fused_rate_in_process_gparam(w3(1, 3.0)) == 3.0
    assert offload_bench.fused_rate_in_process_gparam(_ours(1, 1)) is None
    rows = targets.load_rows([a, b])
    assert [r.profile_host_gparam for r in rows] == [4.0, 4.0]
    (verdict,) = [v for v in targets.verdicts(rows) if v.target == "W3 fp32 state <= 1.15x floor"]
    end = (
        " of gpu_compute 200.0 ms (host_adam 100.0); host parts at 4.00 Gparam/s, the fused"
        " host Adam rate its machine's processes read (the profile read 1.00)"
    )
    assert verdict.cells == [
        f"s99c1_a ours: 1.100x (run 1.100x){end}",
        f"s99c2_b ours: 1.200x (run 1.200x){end}",
    ]
    # A floor is a lower bound: of the two readings it takes the faster, however near.
    row = w3(220, 1.4)
    assert offload_bench.floor_parts(row, None, 0.8) == row["floor_parts_ms"]
    assert offload_bench.floor_parts(row, None, 1.0) == row["floor_parts_ms"]
    assert offload_bench.floor_parts(row, None, 1.25)["host_adam"] == pytest.approx(320.0)
    assert offload_bench.floor_parts(row, None, 1.6)["host_adam"] == pytest.approx(250.0)


def test_a_machine_is_a_session_of_named_calls_or_a_calls_own_folder() -> None:
    assert targets._machine("s47c3", {"profile_host_adam_gparam": 1.4}) == ("s47", 1.4)
    # A folder's path is its own call: "c" inside it splits nothing.
    assert targets._machine("/tmp/calc1", {}) == ("/tmp/calc1", 0.0)


def test_a_machine_profiled_again_keeps_its_readings_together(tmp_path: Path) -> None:
    # Session 53's call 3: rows planned with a cached profile that read 1 Gparam/s read
    # 3 and 4 in process; then a row read 9, took the profile again (2) and planned with
    # it. One machine: its readings 3, 4 and 9 give the median 4 to every row, where keyed
    # by the profile alone the last row's floor took its one reading (9).
    def w3(step: float, sample: float, profile: float) -> dict[str, Any]:
        return {
            **_ours(step, step),
            "floor_parts_ms": {"host_adam": 400.0 / profile, "h2d": 50.0},
            "profile_host_adam_gparam": profile,
            "host_rate_samples_gparam": [sample, sample, sample],
            "host_step_cost": 1.0,
        }

    again = w3(240, 9.0, 2.0) | {
        "reprofiled": {"cached_gparam": 1.0, "in_process_gparam": 9.0, "now_gparam": 2.0}
    }
    a = _write(tmp_path / "s99c3_a.json", {"W3": {"ours": w3(220, 3.0, 1.0)}})
    b = _write(tmp_path / "s99c3_b.json", {"W3": {"ours": w3(230, 4.0, 1.0)}})
    c = _write(tmp_path / "s99c3_c.json", {"W3": {"ours": again}})
    # Another machine of the session (another lease) keeps its own reading.
    d = _write(tmp_path / "s99c1_d.json", {"W3": {"ours": w3(250, 6.0, 5.0)}})
    rows = targets.load_rows([a, b, c, d])
    assert [r.profile_host_gparam for r in rows] == [4.0, 4.0, 4.0, 6.0]
    assert targets._reprofiled_from("s99c3", again) == ("s99", 1.0)
    assert targets._reprofiled_from("s99c3", w3(1, 1.0, 1.0)) is None
    # Without the link each profile is a machine of its own.
    rows = targets.load_rows(
        [a, b, _write(tmp_path / "s99c3_e.json", {"W3": {"ours": w3(240, 9.0, 2.0)}})]
    )
    assert [r.profile_host_gparam for r in rows] == [3.5, 3.5, 9.0]


def test_machines_joins_chains_of_profiles() -> None:
    find = targets._machines([(("s1", 3.0), ("s1", 2.0)), (("s1", 2.0), ("s1", 1.0))])
    assert {find(("s1", x)) for x in (1.0, 2.0, 3.0)} == {("s1", 1.0)}
    assert find(("s1", 4.0)) == ("s1", 4.0)
    assert find(("s2", 1.0)) == ("s2", 1.0)
