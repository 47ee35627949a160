"""ckpt_peers.py on the CPU: blocks checkpointed, with and without their saved tensors on the
host, train as the model unwrapped does (the same loss and gradients), and recompute each
block's forward in backward; checkpointed full-GPU training's recipe runs. The FSDP2 arms
need CUDA and NCCL: not run here."""

from __future__ import annotations

import copy
from typing import Any

import offload_bench
import pytest
import torch
from ckpt_peers import CKPT_PEERS, FSDP2_ARMS, FULL_GPU_CKPT, CkptPeer, checkpoint_blocks

from offload_gpt_example.models import build_model, lm_loss, random_batch


def loss_and_grads(model: Any, data: dict[str, Any], peer: CkptPeer) -> tuple[Any, list[Any]]:
    """One forward under ``peer``'s context and backward, dropout drawn from seed 3."""
    torch.manual_seed(3)
    with peer.forward_context()():
        loss = lm_loss(model(**data), data["input_ids"])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_the_peers_are_the_fsdp2_arms_and_full_gpu() -> None:
    assert set(CKPT_PEERS) == {*FSDP2_ARMS, FULL_GPU_CKPT}
    assert [CKPT_PEERS[k].host for k in FSDP2_ARMS] == [False, True]
    assert all(CKPT_PEERS[k].fsdp for k in FSDP2_ARMS) and not CKPT_PEERS[FULL_GPU_CKPT].fsdp
    assert set(CKPT_PEERS) <= set(offload_bench.PEERS)


@pytest.mark.parametrize("name", ["gpt2_tiny", "llama_tiny"])
@pytest.mark.parametrize("host", [False, True])
def test_checkpointed_blocks_give_the_unwrapped_loss_and_gradients(name: str, host: bool) -> None:
    torch.manual_seed(0)
    plain = build_model(name, device="cpu", dtype=torch.float32, seq_len=16)
    wrapped = copy.deepcopy(plain)
    assert checkpoint_blocks(wrapped) == len(plain.blocks()) >= 2
    data = random_batch(2, 16, device="cpu", vocab_size=plain.config.vocab_size)
    # Each block's forward runs once in the forward and once more in backward.
    # (Counted in each block's forward itself: module hooks do not fire on recomputation.)
    calls: list[int] = []
    for block in wrapped.blocks():
        inner = block._checkpoint_wrapped_module

        def counted(*args: Any, forward: Any = inner.forward, **kwargs: Any) -> Any:
            calls.append(1)
            return forward(*args, **kwargs)

        inner.forward = counted
    want_loss, want = loss_and_grads(plain, data, CkptPeer(fsdp=False))
    got_loss, got = loss_and_grads(wrapped, data, CkptPeer(fsdp=True, host=host))
    assert len(calls) == 2 * len(plain.blocks())
    assert torch.equal(got_loss, want_loss)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is not None and w is not None
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_checkpointed_full_gpu_steps_as_full_gpu_does(tiny: tuple[str, str]) -> None:
    torch.manual_seed(0)
    full = offload_bench._full_gpu_steps(tiny[0], device="cpu")
    torch.manual_seed(0)
    ckpt = offload_bench._full_gpu_steps(tiny[0], device="cpu", ckpt=CKPT_PEERS[FULL_GPU_CKPT])
    for steps in (full, ckpt):
        torch.manual_seed(1)
        steps.step()
    for p, q in zip(full.parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())


def test_a_checkpointed_full_gpu_row_records_whether_it_trained(tiny: tuple[str, str]) -> None:
    row = offload_bench._full_gpu(tiny[0], 1, 5, device="cpu", kind=FULL_GPU_CKPT)
    assert len(row["steps_ms"]) == 5 and row["fwd_bwd_ms"] > 0
    assert offload_bench.trained(row)
