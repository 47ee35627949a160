"""Adam update kernels: torch's fused Adam, and a chunked route for bf16 moments.

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
``HybridAdam(host_kernel="single_pass")`` has one (see single_pass.py).
Round-to-nearest is deterministic (resuming from a checkpoint reproduces the run bit for
bit); its known cost is that the second moment cannot decay by less than half a bf16 ulp
(2**-9 relative) per step, so it tracks shrinking gradients with some lag. The loss-curve
effect is measured in tests/test_bf16_moments.py.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from offload_runtime.hardware import HostStep, measure_host_step

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
one-pass kernels of ``offload_optim.single_pass`` (numba)."""

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
    overlap.py. It is non-finite exactly when an element is: the fp32 sum of finite gradients
    of fp16 training cannot overflow by itself (see ``clipping.partials_of``), and a plain sum
    reads faster than the L1 norm on the CPU (no absolute values).
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


def measure_host_step_params_per_s(
    moments_dtype: torch.dtype = torch.float32,
    numel: int = 64 << 20,
    *,
    steps: int = 3,
    host_kernel: str = "torch",
    speculative: bool = False,
    fp16_io: bool = False,
) -> float:
    """Host Adam(W) throughput of :func:`fused_adam_` with ``moments_dtype`` moments:
    parameters per second over ``numel`` fp32 parameters, timed by
    ``offload_runtime.hardware.measure_host_step`` (one untimed step that touches every
    page, then the median of ``steps`` timed steps, with torch's current thread count), as
    the hardware profile's fused Adam rate is.

    What the planner should charge per host-state parameter when the optimizer is not
    torch's fused fp32-moment Adam, e.g. ``memory_optimize(...,
    host_step_params_per_s=measure_host_step_params_per_s(torch.bfloat16))``. A single
    reading taken while the host is slower for a while misleads the plan: the example
    and the benchmark plan with the median of a few readings of the kernel the optimizer
    runs, and nothing else (BENCHMARKS.md, Decisions, "Planning from the kernel's own
    rate samples"). Given :func:`measure_host_step_cost` too
    (``memory_optimize(host_step_cost=)``), the planner takes the geometric mean of this
    rate and the profile's fused rate over the cost. Needs about ``(8 + 2 * moment
    bytes) * numel`` bytes of host memory. ``host_kernel="single_pass"`` times
    ``offload_optim.single_pass.adam_`` instead (what ``HybridAdam(host_kernel=...)``
    steps with; needs numba). ``speculative=True`` times the step that keeps undo data
    (that kernel's ``speculative_adam_``: what ``AMPOptimizer(speculate_fp16=True)`` runs
    under backward; ``4 + 2 * moment bytes`` more per parameter); see
    :func:`measure_speculative_step_cost` for the ratio the planner takes.
    ``fp16_io=True`` (single-pass, fp32 or bf16 moments) times the kernels of
    ``HybridAdam(fp16_io=True)``, which read an fp16 gradient and write an fp16 copy of
    the master in the same pass (2 more bytes per parameter of host memory, 2 fewer).
    """
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    kind = _host_steps(moments_dtype, numel, host_kernel, fp16_io)
    step = kind.speculative if speculative else kind.plain
    return measure_host_step(step, numel, steps=steps).params_per_s


def measure_host_step_cost(
    moments_dtype: torch.dtype = torch.float32,
    numel: int = 64 << 20,
    *,
    host_kernel: str = "torch",
    fp16_io: bool = False,
    pairs: int = 5,
    gap_s: float = 0.05,
) -> float:
    """How many times the time of torch's fused fp32-moment Adam step a host step of this
    kind takes: what ``memory_optimize(..., host_step_cost=)`` should be given for an
    optimizer that is not torch's fused fp32 Adam (the hardware profile measures that one).

    The median, over ``pairs`` back-to-back pairs, of this kind's step time over the fused
    fp32 step's (each the median of 3 steps by ``offload_runtime.hardware.measure_host_step``,
    as in :func:`measure_host_step_params_per_s`), both over ``numel`` parameters with
    torch's current thread count. A ratio taken back to back holds when the host is slower
    for a while, where an absolute rate does not. Below 1 when the kind moves fewer bytes
    (bf16 moments with ``host_kernel="single_pass"``). Needs about
    ``(16 + 8 + 2 * moment bytes) * numel`` bytes of host memory.

    The two halves of a pair take turns going first, and each sleeps ``gap_s`` seconds
    after its untimed step (``measure_host_step``'s ``settle_s``): torch's and numba's
    thread pools are separate, and a pool that has just finished may keep its threads
    spinning on the cores the other one needs, which slows whichever runs second. About
    ``2 * pairs * (gap_s + 4 steps)`` seconds in all.
    """
    if pairs < 1:
        raise ValueError(f"pairs ({pairs}) must be >= 1")
    if gap_s < 0:
        raise ValueError(f"gap_s ({gap_s}) must be >= 0")
    fused = _host_steps(torch.float32, numel, "torch").plain
    kind = _host_steps(moments_dtype, numel, host_kernel, fp16_io).plain

    def settled(step: HostStep) -> float:
        return measure_host_step(step, numel, steps=3, settle_s=gap_s).median_s

    ratios = []
    for i in range(pairs):
        if i % 2:
            fused_s = settled(fused)
            kind_s = settled(kind)
        else:
            kind_s = settled(kind)
            fused_s = settled(fused)
        ratios.append(kind_s / max(fused_s, 1e-9))
    return statistics.median(ratios)


def measure_speculative_step_cost(
    moments_dtype: torch.dtype = torch.float32,
    numel: int = 64 << 20,
    *,
    host_kernel: str = "torch",
    pairs: int = 3,
    fp16_io: bool = False,
) -> float:
    """How many times a plain host step a speculative one takes (>= 1): what
    ``memory_optimize(..., speculative_step_cost=)`` should charge the fp16 host steps
    that ``AMPOptimizer(speculate_fp16=True)`` takes under backward.

    The median, over ``pairs`` back-to-back pairs on one set of buffers, of the time of
    a speculative step over that of a plain one (each the median of 3 steps by
    ``offload_runtime.hardware.measure_host_step``, as in
    :func:`measure_host_step_params_per_s`; one pair varies a lot on a shared host).
    Lower with ``host_kernel="single_pass"``, which writes the undo data in the step's
    own pass, than with torch's kernel. Needs about ``(12 + 4 * moment bytes) * numel``
    bytes of host memory. ``fp16_io``: the fp16-I/O kernels' ratio, as in
    :func:`measure_host_step_params_per_s`.
    """
    if pairs < 1:
        raise ValueError(f"pairs ({pairs}) must be >= 1")
    kind = _host_steps(moments_dtype, numel, host_kernel, fp16_io)

    def median_s(step: HostStep) -> float:
        return measure_host_step(step, numel, steps=3).median_s

    ratios = [median_s(kind.speculative) / max(median_s(kind.plain), 1e-9) for _ in range(pairs)]
    return max(1.0, statistics.median(ratios))


class _HostSteps(NamedTuple):
    """A plain and a speculative host step of one kind over the same buffers."""

    plain: HostStep
    speculative: HostStep


def _host_steps(
    moments_dtype: torch.dtype, numel: int, host_kernel: str, fp16_io: bool = False
) -> _HostSteps:
    """The steps of one kind of host Adam(W) over ``numel`` parameters, for
    ``offload_runtime.hardware.measure_host_step`` to time: buffers allocated once (the
    speculative step's spare buffers at its first call, which the timer does not time);
    each step is called with its count (bias correction). ``fp16_io``: the single-pass
    kernels that read an fp16 gradient and write an fp16 copy of the master."""
    if numel < 1:
        raise ValueError(f"numel ({numel}) must be >= 1")
    if moments_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moments_dtype must be float32 or bfloat16, not {moments_dtype}")
    if host_kernel not in HOST_KERNELS:
        raise ValueError(f"host_kernel must be one of {HOST_KERNELS}, not {host_kernel!r}")
    if fp16_io and host_kernel != "single_pass":
        raise ValueError("fp16_io times the single-pass kernels (host_kernel='single_pass')")
    if host_kernel == "single_pass":
        from offload_optim import single_pass  # it imports this module

        single_pass.require()
        plain: Callable[..., Any] = single_pass.adam_
        undo: Callable[..., Any] = single_pass.speculative_adam_
    else:
        plain, undo = _fused_one, speculative_adam_
    param = torch.zeros(numel)
    grad = torch.full((numel,), 1e-3, dtype=torch.float16 if fp16_io else torch.float32)
    if fp16_io:
        single_pass.require_fp16_io()
        upload = torch.empty(numel, dtype=torch.float16)  # the fp16 copy the kernels write

        def plain_io(p: Any, g: Any, m: Any, v: Any, step: Any, hyper: Any) -> None:
            single_pass.adam_fp16_io_(p, g, m, v, upload, step, hyper)

        def undo_io(p: Any, g: Any, m: Any, v: Any, nm: Any, nv: Any, b: Any, *rest: Any) -> Any:
            return single_pass.speculative_adam_fp16_io_(p, g, m, v, nm, nv, b, upload, *rest)

        plain, undo = plain_io, undo_io
    exp_avg = torch.zeros(numel, dtype=moments_dtype)
    exp_avg_sq = torch.zeros(numel, dtype=moments_dtype)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    spare: list[torch.Tensor] = []

    def plain_step(count: int) -> object:
        return plain(param, grad, exp_avg, exp_avg_sq, torch.tensor(float(count)), hyper)

    def speculative_step(count: int) -> object:
        if not spare:
            spare.extend((torch.zeros_like(exp_avg), torch.zeros_like(exp_avg_sq)))
            spare.append(torch.zeros_like(param))
        step = torch.tensor(float(count))
        return undo(param, grad, exp_avg, exp_avg_sq, *spare, step, hyper)

    return _HostSteps(plain=plain_step, speculative=speculative_step)


def _fused_one(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
) -> None:
    """:func:`fused_adam_` of one tensor, with the signature of ``single_pass.adam_``."""
    fused_adam_([param], [grad], [exp_avg], [exp_avg_sq], [step], hyper)
