"""What the planner reads from the training device: the bytes already in use on it, and
the traced model's matrix products (the shapes the hardware profile times)."""

from __future__ import annotations

import gc

import torch
from torch import fx

from offload_runtime.hardware import MatmulShape


def measure_device_bytes_in_use(
    device: torch.device, model: torch.nn.Module | None = None, dtype: torch.dtype = torch.float16
) -> int:
    """Device bytes allocated now that stay allocated while ``model`` trains, beside what a
    plan places: what ``solve(device_bytes_in_use=)`` takes off the budget.

    That is everything the caching allocator holds on ``device`` (the inputs, the
    caller's other tensors, and the BLAS libraries' workspaces, allocated here by one small
    ``dtype`` matrix product forward and backward if training has not run yet), less
    ``model``'s own parameters and buffers on ``device``, which the offloaded module
    copies into its own storage. On the CPU: 0 (no device allocator to ask).
    """
    if device.type != "cuda":
        return 0
    # Garbage first: tensors that only a reference cycle keeps (the frames of an exception
    # caught by the caller, such as a previous plan's InfeasibleBudgetError, hold the
    # planner's device tensors until the cyclic collector runs) would otherwise be counted
    # as in use, and the least budget that error named would not plan.
    gc.collect()
    with torch.cuda.device(device):
        # cuBLAS keeps a workspace per handle and stream, taken from the caching allocator
        # at the first product and held from then on: one for the thread that runs forward,
        # one for autograd's device thread that runs backward. A first training step would
        # allocate them; do it now so that they are counted. Both kinds of product a
        # model runs: a plain one, and one with a vector bias (cuBLASLt's path).
        x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        bias = torch.ones(16, device=device, dtype=dtype, requires_grad=True)
        out = torch.addmm(x, x, x).sum() + torch.nn.functional.linear(x, x, bias).sum()
        torch.autograd.backward(out)
        del x, bias, out
        torch.cuda.synchronize(device)  # sync point: backward's frees are done
        used = torch.cuda.memory_allocated(device)
    own = 0 if model is None else model_bytes_on(model, device)
    return max(0, used - own)


def model_bytes_on(model: torch.nn.Module, device: torch.device) -> int:
    """Bytes of ``model``'s parameters and buffers stored on ``device``, each storage
    once: what the offloaded module's own storage replaces once the caller lets the model
    go (the planner counts them as free, on the device and in host memory alike)."""
    own = 0
    seen: set[int] = set()
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        if t.device == device and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            own += storage.nbytes()
    return own


def matmul_shapes(gm: fx.GraphModule) -> list[MatmulShape]:
    """The (m, k, n) of every matrix product in a traced graph, for compute profiling."""
    out: list[MatmulShape] = []
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        vals = [a.meta.get("val") for a in node.all_input_nodes]
        if node.target in (aten.mm.default, aten.addmm.default, aten.linear.default):
            tensors = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2]
            if node.target is aten.addmm.default:
                tensors = tensors[-2:]
            if len(tensors) < 2:
                continue
            x, w = tensors[0], tensors[1]
            m = x.numel() // x.shape[-1]
            k = x.shape[-1]
            n = w.shape[0] if node.target is aten.linear.default else w.shape[-1]
            out.append((int(m), int(k), int(n)))
    return out


__all__ = ["matmul_shapes", "measure_device_bytes_in_use", "model_bytes_on"]
