"""Regions: linearisation at parameter boundaries, tied storage, pinning, block size."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from solver_helpers import profiles

from offload_solver import ModelProfile, Operation, Parameter, build_regions
from offload_solver.regions import (
    block_waste_bytes,
    linearise,
    search_block_size,
    search_block_size_brute_force,
)


def gpt_like() -> ModelProfile:
    params = (
        Parameter("wte", 100, 200),
        Parameter("wpe", 10, 20),
        Parameter("ln.w", 4, 8),
        Parameter("ln.b", 4, 8),
        Parameter("fc1", 50, 100),
        Parameter("fc2", 50, 100),
        Parameter("lm_head", 100, 200),
    )
    ops = (
        Operation("tok", ("wte",)),
        Operation("pos", ("wpe",)),
        Operation("add"),
        Operation("ln", ("ln.w", "ln.b")),
        Operation("fc1", ("fc1",)),
        Operation("relu"),
        Operation("fc2", ("fc2",)),
        Operation("head", ("lm_head",)),
    )
    return ModelProfile("gpt", params, ops, tied_groups=(("wte", "lm_head"),))


def test_linearise_starts_regions_at_new_parameters_and_pins_tied_weights() -> None:
    regions = linearise(gpt_like())
    assert [(r.op_start, r.op_end) for r in regions] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 8)]
    assert [r.param_names for r in regions] == [
        ("wte",),
        ("wpe",),
        ("ln.w", "ln.b"),
        ("fc1",),
        ("fc2",),
    ]
    # wte is read again by the head (op 7, in region 4): region 0 must stay resident.
    assert [r.pinned for r in regions] == [True, False, False, False, False]
    # The tied head adds no storage: region 4 holds fc2 only.
    assert regions[4].size_bytes == 100


def test_operations_before_the_first_parameter_join_region_zero() -> None:
    profile = ModelProfile(
        "p",
        (Parameter("w", 3, 6),),
        (Operation("a"), Operation("b"), Operation("mm", ("w",)), Operation("c")),
    )
    regions = linearise(profile)
    assert len(regions) == 1
    assert (regions[0].op_start, regions[0].op_end, regions[0].param_names) == (0, 4, ("w",))


def test_tied_group_is_owned_where_any_member_is_first_used() -> None:
    params = (
        Parameter("x", 1, 1),
        Parameter("a", 5, 10),
        Parameter("b", 5, 10),
        Parameter("c", 5, 10),
    )
    # The group's storage owner is "a" (first listed), but "c" is used first.
    ops = (Operation("o0", ("x",)), Operation("o1", ("c",)), Operation("o2", ("b", "a")))
    profile = ModelProfile("t", params, ops, tied_groups=(("a", "b", "c"),))
    regions = linearise(profile)
    assert [r.param_names for r in regions] == [("x",), ("a",)]
    assert regions[1].size_bytes == 10  # three members, one storage
    assert sum(r.size_bytes for r in regions) == profile.total_param_bytes == 11
    assert not regions[1].pinned  # all uses are inside region 1 (ops 1-2)


def test_unused_parameters_are_kept_with_the_last_region() -> None:
    profile = ModelProfile(
        "u",
        (Parameter("w", 2, 4), Parameter("unused", 3, 6)),
        (Operation("mm", ("w",)), Operation("relu")),
    )
    regions = linearise(profile)
    assert regions[-1].param_names == ("w", "unused")
    assert regions[-1].size_bytes == 10


@pytest.mark.parametrize(
    ("runs", "range_bytes", "expected"),
    [
        # start 5: B=5 packs [3][5][4] wasting 2+0+1 = 3; B=8 packs [3,5][4] wasting 0+4.
        ([[3, 5, 4]], 6, 5),
        # start 6: B=6 wastes 1+1+0 = 2 ([5][3,2][6]); B=8 packs [5,3][2,6] wasting 0.
        ([[5, 3, 2, 6]], 6, 8),
        # One run [6,3,2,5] fits a single block of 16 (waste 0; B=6 packs [6][3,2][5]: 0+1+1)
        ([[6, 3, 2, 5]], 10, 16),
        # ... but a pinned region between [6,3] and [2,5] closes a block there: B=16 wastes
        # 7+9, while B=9 packs [6,3] and [2,5] wasting 0+2 (B=6: 0+3+4+1; B=7: 1+4+0).
        ([[6, 3], [2, 5]], 10, 9),
    ],
)
def test_block_size_by_hand(runs: list[list[int]], range_bytes: int, expected: int) -> None:
    assert search_block_size(runs, 1, range_bytes) == expected
    assert search_block_size_brute_force(runs, 1, range_bytes) == expected


def test_block_waste_definition() -> None:
    assert block_waste_bytes([[5, 3, 2, 6]], 6) == 2
    assert block_waste_bytes([[5, 3, 2, 6]], 8) == 0
    assert block_waste_bytes([[5, 3], [2, 5]], 8) == 0 + 1  # [5,3] full, [2,5] one short
    assert block_waste_bytes([[5, 3], [2, 5]], 15) == 7 + 8
    assert block_waste_bytes([], 8) == 0


@settings(max_examples=300, deadline=None)
@given(
    runs=st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=9), min_size=1, max_size=3),
    step=st.integers(1, 9),
    range_bytes=st.integers(0, 150),
)
def test_fast_block_search_equals_the_brute_force_scan(
    runs: list[list[int]], step: int, range_bytes: int
) -> None:
    assert search_block_size(runs, step, range_bytes) == search_block_size_brute_force(
        runs, step, range_bytes
    )


def test_fast_block_search_equals_the_scan_at_the_reference_granularity() -> None:
    # 1 KiB steps over 128 MiB: 131,073 candidates for the scan.
    kib = 1024
    runs = [[300 * kib, 700 * kib + 5, 1000 * kib, 20 * kib, 650 * kib], [999 * kib, 1 * kib]]
    assert search_block_size(runs) == search_block_size_brute_force(runs)


@settings(max_examples=150, deadline=None)
@given(profile=profiles())
def test_layout_invariants(profile: ModelProfile) -> None:
    layout = build_regions(profile, step_bytes=8, range_bytes=256)
    regions = layout.regions
    canon = profile.canonical_names()
    # Regions partition the operations in order.
    assert regions[0].op_start == 0 and regions[-1].op_end == len(profile.operations)
    assert all(a.op_end == b.op_start for a, b in itertools.pairwise(regions))
    assert all(r.op_start < r.op_end for r in regions)
    assert [r.index for r in regions] == list(range(len(regions)))
    # Every storage is owned exactly once; tied members count once.
    owned = [n for r in regions for n in r.param_names]
    assert sorted(owned) == sorted(set(canon.values()))
    assert sum(r.size_bytes for r in regions) == profile.total_param_bytes
    assert sum(r.numel for r in regions) == profile.total_param_numel
    # Pinned exactly when an owned parameter is used outside the region's operations.
    owner = {n: r for r in regions for n in r.param_names}
    for r in regions:
        outside = any(
            owner[canon[p]] is r and not r.op_start <= i < r.op_end
            for i, op in enumerate(profile.operations)
            for p in op.param_names
        )
        assert r.pinned == outside
        # Each offloadable region fits one pool block.
        if not r.pinned:
            assert r.size_bytes <= layout.block_size_bytes
    # The chosen block size is the brute-force scan's answer over the pre-merge regions.
    initial = linearise(profile)
    runs: list[list[int]] = [[]]
    for reg in initial:
        if reg.pinned:
            runs.append([])
        else:
            runs[-1].append(reg.size_bytes)
    runs = [run for run in runs if run]
    assert layout.block_size_bytes == search_block_size_brute_force(runs, 8, 256)
