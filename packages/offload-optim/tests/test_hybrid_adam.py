"""HybridAdam steps exactly like torch's fused Adam(W), on plain tensors and on regions."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import batch, loss_of, offload_module, tiny_gpt2

from offload_optim import HybridAdam
from offload_solver import PlanOptions


def tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in [(7, 5), (5,), (3, 4, 2), (1,)]]


def set_grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("adamw", [True, False])
def test_plain_tensors_step_like_torch_fused(adamw: bool) -> None:
    ours, theirs = tensors(0), tensors(0)
    groups = [{"params": ours[:2]}, {"params": ours[2:], "lr": 3e-2, "weight_decay": 0.0}]
    opt = HybridAdam(groups, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, adamw_mode=adamw)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls(
        [{"params": theirs[:2]}, {"params": theirs[2:], "lr": 3e-2, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.8, 0.99),
        weight_decay=0.1,
        fused=True,
    )
    for step in range(5):
        set_grads(ours, step)
        set_grads(theirs, step)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("adamw", [True, False])
def test_single_pass_kernel_steps_like_torch_up_to_rounding(adamw: bool) -> None:
    """A plan of the single-pass kernel, on plain tensors and region masters: torch's
    Adam(W) up to rounding, over several steps. A non-contiguous plain tensor takes torch's
    kernel (its result is then torch's, bit for bit)."""
    base = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    ours, theirs = [*tensors(2), base.t()], [*tensors(2), base.clone().t()]
    assert not ours[-1].is_contiguous()
    module = offload_module(tiny_gpt2(), batch(0), options=PlanOptions(host_kernel="single_pass"))
    masters = [p for _, p in module.named_parameters()]
    copies = [p.detach().clone() for p in masters]
    opt = HybridAdam([*ours, *masters], lr=1e-2, weight_decay=0.1, adamw_mode=adamw)
    opt.bind(module)
    assert opt.host_kernel == "single_pass", "the plan's kernel"
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = cls([*theirs, *copies], lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        set_grads([*ours, *masters], step)
        set_grads([*theirs, *copies], step)
        opt.step()
        ref.step()
    assert torch.equal(ours[-1], theirs[-1]), "the non-contiguous tensor took torch's kernel"
    moved = 4 * 1e-2  # an Adam update is about lr per step: the scale of the rounding
    for a, b in zip([*ours, *masters], [*theirs, *copies], strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * moved
    assert any(not torch.equal(a, b) for a, b in zip(masters, copies, strict=True)), (
        "the single-pass kernel ran (its rounding differs somewhere)"
    )


def test_loads_a_torch_adamw_checkpoint_and_continues_identically() -> None:
    ours, theirs = tensors(1), tensors(1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        set_grads(theirs, step)
        ref.step()
    with torch.no_grad():
        for a, b in zip(ours, theirs, strict=True):
            a.copy_(b)
    opt = HybridAdam(ours, lr=1.0)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2
    for step in range(3, 6):
        set_grads(ours, step)
        set_grads(theirs, step)
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_region_masters_step_like_per_parameter_torch_adamw() -> None:
    """Flat per-region steps equal torch's per-parameter steps, bit for bit.

    The gradients are assigned by hand to the master views, so this also checks that such
    gradients are copied into the region's accumulator that the step reads.
    """
    module = offload_module(tiny_gpt2(), batch(0))
    masters = [p for _, p in module.named_parameters()]
    copies = [p.detach().clone() for p in masters]
    opt = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.1)
    opt.bind(module)
    ref = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        set_grads(masters, step)
        set_grads(copies, step)
        opt.step()
        ref.step()
    for (name, a), b in zip(module.named_parameters(), copies, strict=True):
        assert torch.equal(a, b), name
    # The step published the new weights into every region's training copy.
    for st in module.storages:
        published = st.host_params if st.offloaded else st.device_params
        assert published is not None
        assert torch.equal(published, st.master)


def test_regions_without_gradients_are_not_stepped() -> None:
    """Like torch: parameters whose .grad is None are left alone, the others step."""
    module = offload_module(tiny_gpt2(), batch(0))
    opt = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.1)
    opt.bind(module)
    b = batch(0)
    before = [st.master.clone() for st in module.storages]
    module.backward(loss_of(module(**b), b["input_ids"]))
    for view in module.storages[1].master_views.values():
        view.grad = None
    opt.step()
    for st, old in zip(module.storages, before, strict=True):
        assert torch.equal(st.master, old) == (st.index == 1), st.index


def test_some_gradients_none_inside_a_region_is_an_error() -> None:
    module = offload_module(tiny_gpt2(), batch(0))
    opt = HybridAdam(module.parameters())
    opt.bind(module)
    b = batch(0)
    module.backward(loss_of(module(**b), b["input_ids"]))
    st = next(s for s in module.storages if len(s.master_views) > 1 and not s.host_state)
    next(iter(st.master_views.values())).grad = None
    with pytest.raises(RuntimeError, match="set_to_none=False"):
        opt.step()


def test_bad_arguments_are_named() -> None:
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="lr=-1"):
        HybridAdam(p, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        HybridAdam(p, betas=(0.9, 1.0))
