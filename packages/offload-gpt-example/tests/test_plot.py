"""The plan picture: a valid PNG of bounded size for any plan, including an empty timeline."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from offload_gpt_example.plot import plan_figure, save_plan_png
from offload_solver import (
    MemorySample,
    ParamPlacement,
    Plan,
    Region,
    RegionPlan,
    StatePlacement,
    Stream,
    TimelineInterval,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _synthetic_plan(num_regions: int = 6) -> Plan:
    """A hand-made plan: region 0 resident, the rest async with a host step each."""
    regions = []
    timeline = []
    memory = []
    t = 0.0
    for i in range(num_regions):
        region = Region(
            index=i, op_start=i, op_end=i + 1, param_names=(f"p{i}",), numel=1000, size_bytes=2000
        )
        placement = ParamPlacement.RESIDENT if i == 0 else ParamPlacement.ASYNC
        regions.append(
            RegionPlan(
                region=region,
                placement=placement,
                state=StatePlacement.DEVICE if i == 0 else StatePlacement.HOST,
                prefetch_at=None if i == 0 else min(i + 1, num_regions - 1),
                pool_offset_bytes=None if i == 0 else 0,
            )
        )
        if i > 0:
            timeline.append(TimelineInterval(Stream.H2D, i, "prefetch", t, t + 0.5e-3))
        timeline.append(TimelineInterval(Stream.COMPUTE, i, "fwd", t + 0.5e-3, t + 1.5e-3))
        memory.append(MemorySample(t, 10_000 + 1000 * i))
        t += 1.5e-3
    for i in reversed(range(num_regions)):
        timeline.append(TimelineInterval(Stream.COMPUTE, i, "bwd", t, t + 2e-3))
        timeline.append(TimelineInterval(Stream.D2H, i, "grad_offload", t + 2e-3, t + 2.5e-3))
        timeline.append(TimelineInterval(Stream.HOST, i, "host_step", t + 2.5e-3, t + 4e-3))
        memory.append(MemorySample(t, 20_000 - 1000 * i))
        t += 2e-3
    return Plan(
        solver="asyn",
        budget_bytes=24_000,
        regions=tuple(regions),
        predicted_peak_bytes=20_000,
        predicted_step_time_s=t + 2e-3,
        timeline=tuple(timeline),
        memory_curve=tuple(memory),
        pool_size_bytes=2000,
        model_name="synthetic",
        hardware_name="test",
    )


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, "not a PNG file"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_png_is_written_with_the_figure_size(tmp_path: Path) -> None:
    out = save_plan_png(_synthetic_plan(), tmp_path / "sub" / "plan.png")
    assert out.is_file()
    assert _png_size(out) == (1100, 550)
    # The README commits one of these: it must stay small.
    assert out.stat().st_size < 200_000


def test_figure_has_lanes_for_every_stream_and_a_budget_line() -> None:
    plan = _synthetic_plan()
    fig = plan_figure(plan)
    ax_lanes, ax_mem = fig.axes[:2]
    labels = [t.get_text() for t in ax_lanes.get_yticklabels()]
    assert labels == ["host", "D2H", "H2D", "compute"]
    # One broken_barh collection per (lane, kind) present in the timeline.
    kinds = {(iv.stream, iv.kind) for iv in plan.timeline}
    assert len(ax_lanes.collections) == len(kinds)
    ys = [np.asarray(line.get_ydata(), dtype=float) for line in ax_mem.get_lines()]
    horizontal = [float(y[0]) for y in ys if y.size and np.all(y == y[0])]
    # The budget line is in bytes scaled to MiB (24_000 B is far below a GiB).
    assert any(abs(y - plan.budget_bytes / 2**20) < 1e-12 for y in horizontal)


def test_empty_timeline_still_draws(tmp_path: Path) -> None:
    base = _synthetic_plan(1)
    empty = Plan(
        solver="syn",
        budget_bytes=base.budget_bytes,
        regions=base.regions,
        predicted_peak_bytes=0,
        predicted_step_time_s=0.0,
        timeline=(),
        memory_curve=(),
        pool_size_bytes=0,
    )
    out = save_plan_png(empty, tmp_path / "empty.png")
    assert _png_size(out) == (1100, 550)


def test_every_simulated_interval_kind_has_its_own_colour() -> None:
    """Each kind the simulator emits is in the legend with a colour of its own."""
    from offload_gpt_example.plot import _KIND_COLORS, _OTHER_COLOR
    from offload_solver.simulators._engine import KINDS

    assert set(KINDS) <= set(_KIND_COLORS)
    colours = [_KIND_COLORS[k] for k in KINDS]
    assert len(set(colours)) == len(colours) and _OTHER_COLOR not in colours
