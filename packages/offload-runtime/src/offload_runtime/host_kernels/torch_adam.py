"""Host and device Adam kernels on torch's fused Adam, and a chunked route for bf16 moments.

[Note: bf16 moments]
torch's fused Adam (``torch._fused_adam_`` / ``torch._fused_adamw_``, CPU and CUDA) needs
the parameter, gradient and both moments in one dtype; it rejects fp32 weights with bf16
moments. The routes considered for keeping host-resident moments in bf16:
- compute in bf16 (foreach ops on bf16 moments): every intermediate rounds to 8 bits of
  mantissa, so the update is not the fp32 update of bf16-stored moments; rejected;
- ``torch.compile`` an Adam function (inductor writes one C++ loop): one pass, but it
  needs a C++ compiler where training runs and about 20 s of compilation per region size,
  and it stepped slower than fused fp32; rejected;
- chunked upcast (chosen): for each chunk of ``CHUNK_NUMEL`` elements, widen the two bf16
  moment slices into fp32 scratch, run the fused kernel on (param, grad, scratch) and
  narrow the scratch back with round-to-nearest-even. The arithmetic is exactly fp32 Adam
  on the stored (bf16) moments; the only rounding added is the one store per moment per
  step. The scratch of a chunk stays in cache, so main memory sees 2 + 2 bytes per moment
  per step instead of 4 + 4 (20 bytes per parameter instead of 28).
The four dtype conversions per element cost more than the saved memory traffic
(``python benchmarks/host_adam_bench.py`` times both moment dtypes; BENCHMARKS.md, Decisions,
"bf16 moments"): with torch's kernels, bf16 moments save host memory (4 bytes per
parameter, a third of the host-resident optimizer state), not time. A single-pass kernel
(fp32 math on bf16 moments) is needed for the speed-up, and torch ships none:
the single-pass kernels have one (single_pass.py).
Round-to-nearest is deterministic (resuming from a checkpoint reproduces the run bit for
bit); its known cost is that the second moment cannot decay by less than half a bf16 ulp
(2**-9 relative) per step, so it tracks shrinking gradients with some lag. The loss-curve
effect is measured in offload-optim's tests/test_bf16_moments.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

CHUNK_NUMEL = 4 << 20
"""Elements per chunk of the bf16-moment route: 32 MiB of fp32 scratch for both moments.
Each chunk is a few parallel regions, and on a loaded host every parallel region waits
for busy cores, so fewer, larger chunks win (``python benchmarks/host_adam_bench.py
--configs torch_bf16m`` times the route)."""

SPECULATE_CHUNK_NUMEL = 1 << 20
"""Elements per chunk of :func:`speculative_adam_`. A chunk's master, gradient and the three
copies it writes (master backup, next moments) take 20 MiB in fp32: they stay in the host's
last-level cache between the copies and the fused kernel that re-reads them (server hosts
have tens of MiB of L3), so main memory sees each byte once. Much smaller chunks pay a
parallel-region start per chunk on every core. A multiple of 64 elements: torch's CPU
kernel runs a chunk's last ``numel % vector width`` elements through a scalar loop whose
rounding differs from the vector loop, so chunk edges must fall where the unchunked
kernel's vector blocks do for the result to be bit-identical."""

HOST_KERNELS = ("torch", "single_pass")
"""Kernel families that can step host-resident state: torch's fused CPU Adam, or the
one-pass kernels of :mod:`offload_runtime.host_kernels.single_pass` (numba)."""

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
"""Device types with a fused Adam kernel in torch."""


@dataclass(frozen=True)
class AdamHyper:
    """One parameter group's Adam hyperparameters, as a step uses them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw: bool
    """Decoupled weight decay (AdamW) when true, L2 added to the gradient (Adam) otherwise."""

    @staticmethod
    def of_group(group: dict[str, object]) -> AdamHyper:
        """Read a ``torch.optim`` parameter group (``lr`` may be a 0-dim tensor)."""
        betas = group["betas"]
        assert isinstance(betas, tuple | list) and len(betas) == 2
        return AdamHyper(
            lr=_as_float(group["lr"], "lr"),
            beta1=_as_float(betas[0], "betas[0]"),
            beta2=_as_float(betas[1], "betas[1]"),
            eps=_as_float(group["eps"], "eps"),
            weight_decay=_as_float(group["weight_decay"], "weight_decay"),
            adamw=bool(group["adamw_mode"]),
        )


def _as_float(value: object, name: str) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.item())  # a host sync for a CUDA tensor lr: rare by design
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(f"parameter group field {name!r} is {type(value).__name__}, expected a float")


_scratch = threading.local()


def _scratch_pair(device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-thread fp32 scratch for both moments of one chunk (reused: no page faults)."""
    cache: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = getattr(
        _scratch, "by", {}
    )
    _scratch.by = cache
    pair = cache.get((device, numel))
    if pair is None:
        cache.clear()  # CHUNK_NUMEL changed: drop the old size
        pair = (
            torch.empty(numel, dtype=torch.float32, device=device),
            torch.empty(numel, dtype=torch.float32, device=device),
        )
        cache[(device, numel)] = pair
    return pair


def _launch(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None,
) -> None:
    fn = torch._fused_adamw_ if hyper.adamw else torch._fused_adam_
    fn(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=None,
    )


def _chunked(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None,
) -> None:
    """Adam over one flat tensor whose moments are narrower than fp32 (see the note)."""
    p, g = param.view(-1), grad.view(-1)
    m, v = exp_avg.view(-1), exp_avg_sq.view(-1)
    chunk = CHUNK_NUMEL  # read at call time, so a benchmark can tune it
    m32_full, v32_full = _scratch_pair(param.device, chunk)
    n = p.numel()
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        m32, v32 = m32_full[: end - start], v32_full[: end - start]
        m32.copy_(m[start:end])
        v32.copy_(v[start:end])
        _launch([p[start:end]], [g[start:end]], [m32], [v32], [step], hyper, grad_scale)
        m[start:end].copy_(m32)
        v[start:end].copy_(v32)


def scale_tensor(grad_scale: float | None, device: torch.device) -> torch.Tensor | None:
    """The divisor a fused step takes for ``grad_scale`` (0-dim fp32 on ``device``, made
    on the current stream), or None when there is nothing to divide by."""
    if grad_scale is None or grad_scale == 1.0:
        return None
    return torch.full((), grad_scale, dtype=torch.float32, device=device)


def fused_adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step, in place, over tensors on one device.

    ``steps`` holds one 0-dim fp32 tensor per parameter (on its device), already counting
    this step: the kernel reads it for bias correction and does not change it. Gradients
    are divided by ``grad_scale`` (a 0-dim fp32 tensor on the device) when given, and the
    divided gradient is written back, as ``GradScaler.unscale_`` would leave it. Moments
    may be bf16 while parameters are fp32 (see [Note: bf16 moments]); otherwise every
    tensor of one parameter shares its dtype.
    """
    if not params:
        return
    device = params[0].device
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"fused Adam runs on {SUPPORTED_DEVICE_TYPES}, not on {device}; keep the "
            "parameters and optimizer state on the CPU or a CUDA device"
        )
    # The kernel wants one dtype per call: parameters of one call are grouped by it.
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        if p.device != device:
            raise ValueError(f"fused_adam_: parameters on {device} and {p.device} in one call")
        if exp_avgs[i].dtype == p.dtype and exp_avg_sqs[i].dtype == p.dtype:
            by_dtype.setdefault(p.dtype, []).append(i)
        else:
            _chunked(p, grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i], hyper, grad_scale)
    for idx in by_dtype.values():
        _launch(
            [params[i] for i in idx],
            [grads[i] for i in idx],
            [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx],
            [steps[i] for i in idx],
            hyper,
            grad_scale,
        )


@torch.no_grad()
def speculative_adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    next_avg: torch.Tensor,
    next_avg_sq: torch.Tensor,
    backup: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Adam(W) step of a flat fp32 CPU tensor that keeps what an exact undo needs.

    Chunk by chunk (:data:`SPECULATE_CHUNK_NUMEL` elements): copy ``param`` into
    ``backup``, then step ``param`` with moments read from ``exp_avg`` / ``exp_avg_sq`` and
    written to ``next_avg`` / ``next_avg_sq``, which are left untouched. fp32 moments are
    copied into the next ones and stepped there in place; bf16 moments are widened into
    fp32 scratch and the result narrowed into the next ones, as :func:`fused_adam_` does.
    The values equal those of :func:`fused_adam_` bit for bit (same kernel, chunk edges on
    its vector blocks); the gradient is divided by ``grad_scale`` in place, as there.
    ``step`` already counts this step.

    Returns the sum of the gradient before the step (0-dim fp32), read while each chunk is
    in cache: the overflow check of [Note: overlapping the host step with backward] in
    ``offload_optim/overlap.py``. It is non-finite exactly when an element is: the fp32 sum
    of finite gradients of fp16 training cannot overflow by itself (see
    ``offload_optim.clipping.partials_of``), and a plain sum reads faster than the L1 norm
    on the CPU (no absolute values).
    """
    p, g = param.view(-1), grad.view(-1)
    m, v = exp_avg.view(-1), exp_avg_sq.view(-1)
    m_next, v_next = next_avg.view(-1), next_avg_sq.view(-1)
    bak = backup.view(-1)
    n = p.numel()
    if not (g.numel() == m.numel() == v.numel() == m_next.numel() == v_next.numel() == n):
        raise ValueError("speculative_adam_: every tensor must have the parameter's numel")
    if bak.numel() != n or bak.dtype != p.dtype or p.dtype != torch.float32:
        raise ValueError("speculative_adam_ steps fp32 parameters with an fp32 backup")
    if p.device.type != "cpu":
        raise ValueError(f"speculative_adam_ runs on host tensors, not on {p.device}")
    widen = m.dtype != p.dtype
    chunk = SPECULATE_CHUNK_NUMEL  # read at call time, so a benchmark can tune it
    assert chunk % 64 == 0, "chunk edges must fall on the kernel's vector blocks"
    scratch = _scratch_pair(p.device, chunk) if widen else None
    parts: list[torch.Tensor] = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pc, gc = p[start:end], g[start:end]
        bak[start:end].copy_(pc)
        parts.append(gc.sum())  # before the kernel unscales gc
        if scratch is None:
            mc, vc = m_next[start:end], v_next[start:end]
            mc.copy_(m[start:end])
            vc.copy_(v[start:end])
            _launch([pc], [gc], [mc], [vc], [step], hyper, grad_scale)
        else:
            m32, v32 = scratch[0][: end - start], scratch[1][: end - start]
            m32.copy_(m[start:end])
            v32.copy_(v[start:end])
            _launch([pc], [gc], [m32], [v32], [step], hyper, grad_scale)
            m_next[start:end].copy_(m32)
            v_next[start:end].copy_(v32)
    if not parts:
        return torch.zeros((), dtype=torch.float32)
    return torch.stack(parts).sum()
