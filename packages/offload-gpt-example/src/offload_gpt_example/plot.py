"""A picture of a plan's simulated training step: stream lanes and device memory.

The top panel has one lane per stream (compute, host-to-device, device-to-host, and the
host CPU's optimizer step) with every interval of ``Plan.timeline`` coloured by its kind
and labelled with its region when there is room. The bottom panel is
``Plan.memory_curve`` as a step function, with the budget and the solver's planning limit
(0.95 of the budget) drawn as lines.

Only matplotlib's object API and the Agg canvas are used, so plotting neither needs a
display nor changes the process-wide backend.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from offload_solver import ParamPlacement, Plan, Stream

MiB = 2**20
GiB = 2**30

_LANES: tuple[tuple[Stream, str], ...] = (
    (Stream.COMPUTE, "compute"),
    (Stream.H2D, "H2D"),
    (Stream.D2H, "D2H"),
    (Stream.HOST, "host"),
)
# One colour per interval kind (Plan.timeline's vocabulary); unknown kinds get grey.
_KIND_COLORS: dict[str, str] = {
    "fwd": "#4c72b0",
    "bwd": "#dd8452",
    "upload": "#c44e52",
    "param_upload": "#8c564b",
    "prefetch": "#55a868",
    "grad_offload": "#8172b3",
    "host_step": "#937860",
    "device_step": "#da8bc3",
    "grad_widen": "#a1c9f4",
    "grad_partial": "#ffb482",
    "publish": "#c5b0d5",
    # Streamed regions (host state stepped on the device): up, step, down, the host
    # time their copies cost, and their state sent up in the backward (staged).
    "stream_up": "#17becf",
    "stream_step": "#bcbd22",
    "stream_down": "#9edae5",
    "stream_contention": "#dbdb8d",
    "stream_stage": "#2ca02c",
    # Activations: a region's forward run again before its backward, and its saved
    # activations sent to the host after its forward and fetched back before its backward.
    "recompute": "#1f77b4",
    "act_offload": "#e377c2",
    "act_fetch": "#ff9896",
}
_OTHER_COLOR = "#999999"
_BUDGET_SAFETY = 0.95
"""The solvers plan against this fraction of the budget (see offload_solver)."""


def _time_scale(span_s: float) -> tuple[float, str]:
    """A factor and unit that keep the time axis readable."""
    if span_s >= 1.0:
        return 1.0, "s"
    if span_s >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _mem_scale(peak_bytes: int) -> tuple[float, str]:
    if peak_bytes >= GiB:
        return float(GiB), "GiB"
    return float(MiB), "MiB"


def plan_figure(plan: Plan, *, title: str | None = None) -> Figure:
    """The figure for ``plan`` (not saved; see :func:`save_plan_png`)."""
    fig = Figure(figsize=(11, 5.5), dpi=100, layout="constrained")
    ax_lanes, ax_mem = fig.subplots(2, 1, sharex=True, height_ratios=(1.1, 1.0))
    ends = [iv.end_s for iv in plan.timeline] + [s.time_s for s in plan.memory_curve]
    span_s = max([plan.predicted_step_time_s, *ends, 1e-9])
    scale, unit = _time_scale(span_s)

    # Lanes: one broken_barh call per (lane, kind) keeps thousands of intervals cheap.
    by_lane_kind: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    lane_of = {stream: i for i, (stream, _) in enumerate(_LANES)}
    for iv in plan.timeline:
        lane = lane_of[iv.stream]
        by_lane_kind[(lane, iv.kind)].append(
            (iv.start_s * scale, max(iv.end_s - iv.start_s, 0.0) * scale)
        )
    bar_h = 0.7
    # White separators help while bars are wide; on a long timeline they would whiten the lane.
    edge_w = 0.3 if len(plan.timeline) <= 4 * len(_LANES) * 25 else 0.0
    for (lane, kind), spans in sorted(by_lane_kind.items()):
        y = len(_LANES) - 1 - lane  # compute on top
        ax_lanes.broken_barh(
            spans,
            (y - bar_h / 2, bar_h),
            facecolors=_KIND_COLORS.get(kind, _OTHER_COLOR),
            edgecolor="white",
            linewidth=edge_w,
        )
    # Region labels only where the bar is wide enough to hold them (about 2% of the axis).
    min_label_w = 0.02 * span_s * scale
    for iv in plan.timeline:
        width = (iv.end_s - iv.start_s) * scale
        if width >= min_label_w:
            y = len(_LANES) - 1 - lane_of[iv.stream]
            ax_lanes.text(
                (iv.start_s * scale) + width / 2,
                y,
                str(iv.region),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                clip_on=True,
            )
    ax_lanes.set_yticks(range(len(_LANES)))
    ax_lanes.set_yticklabels([label for _, label in reversed(_LANES)])
    ax_lanes.set_ylim(-0.6, len(_LANES) - 0.4)
    kinds_used = sorted({kind for _, kind in by_lane_kind})
    if kinds_used:
        ax_lanes.legend(
            handles=[
                Patch(facecolor=_KIND_COLORS.get(k, _OTHER_COLOR), label=k) for k in kinds_used
            ],
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=7,
            title="interval (region no.)",
            title_fontsize=7,
        )
    ax_lanes.grid(axis="x", alpha=0.3)

    # Memory: a step curve, each sample holding until the next one.
    peak = max(
        [plan.predicted_peak_bytes, plan.budget_bytes, *(s.bytes for s in plan.memory_curve)]
    )
    mscale, munit = _mem_scale(peak)
    if plan.memory_curve:
        times = [s.time_s * scale for s in plan.memory_curve]
        values = [s.bytes / mscale for s in plan.memory_curve]
        times.append(span_s * scale)
        values.append(values[-1])
        ax_mem.step(
            times, values, where="post", color="#4c72b0", linewidth=1.2, label="device memory"
        )
        ax_mem.fill_between(times, values, step="post", color="#4c72b0", alpha=0.15)
    ax_mem.axhline(
        plan.budget_bytes / mscale, color="#c44e52", linestyle="-", linewidth=1.2, label="budget"
    )
    ax_mem.axhline(
        _BUDGET_SAFETY * plan.budget_bytes / mscale,
        color="#c44e52",
        linestyle=":",
        linewidth=1.0,
        label=f"planning limit ({_BUDGET_SAFETY:.2f} x budget)",
    )
    ax_mem.axhline(
        plan.predicted_peak_bytes / mscale,
        color="#555555",
        linestyle="--",
        linewidth=0.8,
        label=f"predicted peak {plan.predicted_peak_bytes / mscale:.2f} {munit}",
    )
    ax_mem.set_ylim(0, peak / mscale * 1.08)
    ax_mem.set_ylabel(f"device memory ({munit})")
    # The timeline is one step started on an idle machine; the predicted step is the
    # period once steps repeat (the host steps run under the next forward), often shorter.
    for ax in (ax_lanes, ax_mem):
        ax.axvline(plan.predicted_step_time_s * scale, color="black", linestyle=":", lw=0.8)
    ax_mem.set_xlabel(
        f"simulated time in one step from an idle machine ({unit}); dotted: the predicted "
        "step once steps repeat"
    )
    ax_mem.set_xlim(0, span_s * scale)
    ax_mem.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax_mem.grid(alpha=0.3)

    offloaded = sum(rp.placement is not ParamPlacement.RESIDENT for rp in plan.regions)
    heading = title if title is not None else plan.model_name or "plan"
    fig.suptitle(
        f"{heading}: solver {plan.solver}, {offloaded}/{len(plan.regions)} regions offloaded, "
        f"budget {plan.budget_bytes / mscale:.2f} {munit}, predicted step "
        f"{plan.predicted_step_time_s * 1e3:.1f} ms",
        fontsize=10,
    )
    return fig


def save_plan_png(plan: Plan, path: Path | str, *, title: str | None = None) -> Path:
    """Draw ``plan`` (see :func:`plan_figure`) into the PNG file ``path``; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = plan_figure(plan, title=title)
    FigureCanvasAgg(fig)  # attaches itself to the figure: render with Agg, no pyplot
    fig.savefig(out, format="png")
    return out


__all__ = ["plan_figure", "save_plan_png"]
