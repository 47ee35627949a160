"""The activation-checkpointing peers of W6: what they change in the peers that
``offload_bench.py`` builds, which measures them with its own FSDP2 and full-GPU rows.

W6's activations do not fit the device, so each peer recomputes every block's forward in
backward (torch's non-reentrant checkpointing, one checkpoint a transformer block):

- ``fsdp2_ckpt``: FSDP2 with ``CPUOffloadPolicy`` as the ``fsdp2`` kind builds it, each
  block checkpointed before it is sharded (the order torchtitan applies them in);
- ``fsdp2_ckpt_host``: the same, its forward under
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so that what autograd saves
  outside the recomputed blocks - the checkpointed blocks' inputs among them - waits for
  backward in pinned host memory;
- ``full_gpu_ckpt``: full-GPU training (``full_gpu_master``: fp16 weights, fp32 masters
  and fused Adam on the device), each block checkpointed.

Nothing here imports torch until called: ``offload_bench.py``'s parent process and
``targets.py`` read only the kinds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


@dataclasses.dataclass(frozen=True)
class CkptPeer:
    """One checkpointing peer: which of ``offload_bench.py``'s peers it builds, and where
    its forward's saved tensors wait for backward."""

    fsdp: bool
    """FSDP2 with ``CPUOffloadPolicy`` (``offload_bench._fsdp2``); else full-GPU training
    with fp32 masters (``offload_bench._full_gpu_steps``)."""
    host: bool = False
    """The forward under ``save_on_cpu``: saved tensors in pinned host memory."""

    def forward_context(self) -> Callable[[], AbstractContextManager[Any]]:
        """What each forward runs under (a new context a call): ``save_on_cpu`` for a
        host peer, nothing otherwise."""
        return host_saved_tensors if self.host else contextlib.nullcontext


FSDP2_CKPT = "fsdp2_ckpt"
FSDP2_CKPT_HOST = "fsdp2_ckpt_host"
FULL_GPU_CKPT = "full_gpu_ckpt"
CKPT_PEERS: dict[str, CkptPeer] = {
    FSDP2_CKPT: CkptPeer(fsdp=True),
    FSDP2_CKPT_HOST: CkptPeer(fsdp=True, host=True),
    FULL_GPU_CKPT: CkptPeer(fsdp=False),
}
"""The checkpointing peers by kind."""
FSDP2_ARMS = (FSDP2_CKPT, FSDP2_CKPT_HOST)
"""The FSDP2 arms W6's targets set ours against, the faster of the two."""


def checkpoint_blocks(model: Any) -> int:
    """Wrap each of ``model.blocks()`` in place in torch's ``checkpoint_wrapper``
    (non-reentrant: keyword arguments pass through, and the block's forward runs again in
    backward with the random-number state it first ran with, so dropout draws the same
    masks). Returns the number of blocks wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    blocks = model.blocks()
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return len(blocks)


def host_saved_tensors() -> AbstractContextManager[Any]:
    """``save_on_cpu``: each tensor autograd saves outside a recomputed block is copied to
    host memory, and back for backward. Pinned where there is a CUDA device to pin for
    (the CPU tests have none; pinning needs one)."""
    import torch

    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
