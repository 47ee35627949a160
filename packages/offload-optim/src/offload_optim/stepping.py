"""How a HybridAdam steps a list of segments: which kernel, and fp16 I/O.

One fused launch per (parameter group, device) over the segments given (see [Note: region
segments] in layout.py): torch's fused Adam(W) on either device, or on the host the
single-pass kernels where the plan says so (``PlanOptions.host_kernel``; [Note: single-pass
host Adam] in offload_runtime/host_kernels/single_pass.py). A host-state region whose fp16
gradient waits in its staging buffer steps from there (below).

[Note: fp16 I/O steps]
An fp16 module that converts on the host moves fp16 across PCIe: a host-state region's
gradients land in its pinned fp16 staging buffer, and its next upload reads an fp16 host
copy (``host_params`` when offloaded, the staging buffer when resident). Without fp16 I/O
the host makes three passes per region and step: widen the gradients into the fp32
accumulator, step, narrow the master into the upload copy. A plan with fp16 I/O
(``PlanOptions.fp16_io``) makes one: the runtime leaves the gradients in the staging buffer
(``OffloadController.keep_staged_grads``, ``RegionStorage.grad_in_staging``), and the
single-pass kernel reads them there and writes the upload copy as it steps
(``single_pass.adam_fp16_io_``), which the publish then uploads without a cast
(``RegionStorage.upload_copy_fresh``). Widening is exact and the narrowing rounds as
``.half()`` does, so master, moments and upload copy equal the three passes' bit for bit.
A speculative step writes the upload copy too; an undo rewrites an offloaded region's copy
from the restored master (a resident region's is cast again at its next publish). The
fp16 gradients stay the only copy until something else needs the fp32 accumulator:
``region_grad``, ``module.named_gradients()`` and a second backward that adds to them
(accumulation: the runtime widens them before that backward's copy overwrites the staging
buffer) widen them first. A region whose step covers only part of it (segments without
gradients) is widened and stepped by the fp32 kernel.

[Note: bf16 masters]
On a bf16-master rung (``OffloadConfig.host_state``: ``"bf16_stochastic"``,
``"bf16_8bit"``, ``"bf16_nearest"``) a host-state region's master is bf16 and is its own
upload copy (see [Note: region storage] in offload_runtime/storage.py). Its step reads the
bf16 gradient where it landed (the staging buffer, or the bf16 accumulator after
micro-batches were added) and rounds the new master to bf16 in the same pass: to nearest
(torchao's numerics), or stochastically with a counter-based hash of (step, region,
offset, element) as its random bits, so that a run is reproducible and a resumed run
continues bit for bit ([Note: low-precision host Adam] in
offload_runtime/host_kernels/low_precision.py).
"""

from __future__ import annotations

from typing import cast

import torch

from offload_optim.layout import RegionAdamState, Segment, StateLayout
from offload_runtime.host_kernels import (
    AdamHyper,
    fused_adam_,
    low_precision,
    scale_tensor,
    single_pass,
)
from offload_runtime.storage import RegionStorage

IO = tuple[torch.Tensor, torch.Tensor]
"""(fp16 gradients, fp16 upload copy) of a region stepped by fp16 I/O."""


class Stepper:
    """Steps segments with the optimizer's host kernel (``"torch"`` or
    ``"single_pass"``) and, with ``fp16_io``, from the fp16 gradients in staging."""

    def __init__(self, layout: StateLayout, host_kernel: str, fp16_io: bool) -> None:
        self.layout = layout
        self.host_kernel = host_kernel
        self.fp16_io = fp16_io
        self.host_state = "fp32"
        """The bound module's host-state rung (``OffloadConfig.host_state``)."""

    def _bf16_master(
        self, seg: Segment, grad: torch.Tensor, hyper: AdamHyper, scale: torch.Tensor | None
    ) -> None:
        """Step segment ``seg`` of a bf16 host master from bf16 ``grad`` (see [Note: bf16
        masters]); its step count is already this step's."""
        region = -1 if seg.storage is None else seg.storage.index
        low_precision.step_bf16_master_(
            self.host_state,
            seg.param,
            grad,
            seg.exp_avg,
            seg.exp_avg_sq,
            seg.step,
            hyper,
            scale,
            seed=low_precision.rounding_seed(int(seg.step), region, seg.start),
            scales=seg.scales,
            numba=self.single_pass(seg.param.device),
        )

    def single_pass(self, device: torch.device) -> bool:
        """Whether segments on ``device`` step by the single-pass kernels."""
        return self.host_kernel == "single_pass" and device.type == "cpu"

    def run(
        self,
        segments: list[Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None = None,
        io: IO | None = None,
    ) -> None:
        """One fused launch per (group, device) over ``segments`` (steps counted here).

        ``hypers``: a ``HybridAdam.hypers()`` snapshot to step with; default: the groups'
        values now. ``io``: (fp16 gradients, fp16 upload copy) of the one host-state
        region that
        ``segments`` cover (see :meth:`staged_io`): the fp16-I/O kernel steps them.
        """
        buckets: dict[tuple[int, torch.device], list[Segment]] = {}
        for seg in segments:
            buckets.setdefault((id(seg.group), seg.param.device), []).append(seg)
        for (group_id, device), segs in buckets.items():
            hyper = AdamHyper.of_group(segs[0].group) if hypers is None else hypers[group_id]
            grads = [seg.grad if seg.grad is not None else seg.param.grad for seg in segs]
            for g in grads:
                if g is None or g.is_sparse:
                    raise RuntimeError("HybridAdam: a parameter has no dense gradient")
            steps = [seg.step for seg in segs]
            torch._foreach_add_(steps, 1.0)
            scale = scale_tensor(grad_scale, device)
            pairs = list(zip(segs, cast(list[torch.Tensor], grads), strict=True))
            if device.type == "cpu" and self.host_state != "fp32":
                # bf16 host masters (region segments only: plain tensors keep their dtype).
                rest = []
                for seg, g in pairs:
                    if seg.storage is not None and seg.storage.master_is_upload_copy:
                        if io is not None:
                            g = io[0][seg.start : seg.start + seg.param.numel()]
                        self._bf16_master(seg, g, hyper, scale)
                    else:
                        rest.append((seg, g))
                pairs = rest
            if self.single_pass(device):
                # Region segments are flat; a plain tensor that is not contiguous (it never
                # steps speculatively) takes torch's kernel.
                fused = []
                for seg, g in pairs:
                    if io is not None:
                        stop = seg.start + seg.param.numel()
                        single_pass.adam_fp16_io_(
                            seg.param,
                            io[0][seg.start : stop],
                            seg.exp_avg,
                            seg.exp_avg_sq,
                            io[1][seg.start : stop],
                            seg.step,
                            hyper,
                            scale,
                        )
                    elif all(
                        t.is_contiguous() for t in (seg.param, g, seg.exp_avg, seg.exp_avg_sq)
                    ):
                        single_pass.adam_(
                            seg.param, g, seg.exp_avg, seg.exp_avg_sq, seg.step, hyper, scale
                        )
                    else:
                        fused.append((seg, g))
                pairs = fused
            fused_adam_(  # returns at once when nothing is left
                [seg.param for seg, _ in pairs],
                [g for _, g in pairs],
                [seg.exp_avg for seg, _ in pairs],
                [seg.exp_avg_sq for seg, _ in pairs],
                [seg.step for seg, _ in pairs],
                hyper,
                scale,
            )

    def staged_io(self, rs: RegionAdamState, segments: list[Segment]) -> IO | None:
        """(fp16 gradients, fp16 upload copy) when region ``rs`` steps by fp16 I/O now.

        That is when its gradient is still in the staging buffer (see [Note: fp16 I/O
        steps]) and ``segments`` cover the whole region: a resident region's upload copy
        is the staging buffer itself, which must then hold every parameter's new value.
        Otherwise a staged gradient is widened here, for the fp32 kernels. Host worker or
        main thread, as the step that calls it.
        """
        st = rs.storage
        if not st.grad_in_staging or st.grad_stale:
            return None
        covered = sum(seg.param.numel() for seg in segments) == st.numel
        if st.master_is_upload_copy and covered:
            return st.staging(), st.master  # a bf16 master: see [Note: bf16 masters]
        if not (self.fp16_io and covered and self.single_pass(st.master.device)):
            with torch.no_grad():
                st.materialize_grad()
            return None
        return st.staging(), st.upload_copy()

    def step_segments(
        self,
        r: int,
        segments: list[Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
    ) -> None:
        """Step ``segments`` of region ``r`` (not publishing it), by fp16 I/O when the
        gradient waits in the staging buffer (see :meth:`staged_io`)."""
        rs = self.layout.regions[r]
        assert not rs.storage.streamed, "streamed regions are issued (issue_region)"
        io = self.staged_io(rs, segments) if rs.storage.host_state else None
        self.run(segments, grad_scale, hypers, io)
        if io is not None:
            consumed(rs.storage)


def consumed(st: RegionStorage, upload_copy_written: bool = True) -> None:
    """After an fp16-I/O step of ``st``: its upload copy is written (unless a streamed
    step wrote the device parameters instead). A resident region's gradient is
    logically zero now (overwritten by the upload copy, which is the staging buffer);
    an offloaded one's stays readable in the staging buffer."""
    if upload_copy_written:
        st.upload_copy_fresh = True
    if not st.offloaded:
        st.grad_in_staging = False
        st.grad_stale = True
