"""Ctrl-C that ends training cleanly, and checkpoints that resume a run exactly.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be (inside backward, or
while the host Adam runs) would leave an optimizer step half-done. :class:`StopOnInterrupt`
turns the first Ctrl-C into a request that the training loop reads between steps: the
step in progress completes, the loop stops, the run prints its summary and may save a
checkpoint. A second Ctrl-C aborts at once, as Python's default does.

A checkpoint (:func:`save_checkpoint`) holds ``AMPOptimizer.state_dict()`` (the fp32
masters, the Adam state, the loss scaler and step count), the steps done and torch's CPU
random state; :func:`load_checkpoint` restores them, so that a resumed run takes the
steps an uninterrupted one would have, bit for bit. Under data parallel the ranks stop
after the same step (:meth:`StopOnInterrupt.agreed`) and the checkpoint is a directory
that every rank writes its share of (``offload_optim.save_distributed``); it resumes on
any number of ranks. It holds no random state (each rank's differs): a resumed
data-parallel run draws other dropout masks than an uninterrupted one would.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from offload_optim import AMPOptimizer, load_distributed, save_distributed
from offload_runtime.distributed import any_rank
from offload_solver import write_atomic

CHECKPOINT_FORMAT = 1
"""Version of what :func:`save_checkpoint` writes; :func:`load_checkpoint` reads only it."""


class StopOnInterrupt:
    """Within ``with``: the first SIGINT sets :attr:`requested` (and says so on stderr),
    a second raises ``KeyboardInterrupt``. Outside the main thread it installs nothing
    (signals reach the main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\ninterrupt: finishing the step in progress, then stopping "
            "(Ctrl-C again to abort now)",
            file=sys.stderr,
            flush=True,
        )

    def agreed(self) -> bool:
        """Whether to stop now: :attr:`requested` on this rank or, under data parallel,
        on any rank (one all-reduce; :attr:`requested` is then set here too), so that
        every rank stops after the same step."""
        self.requested = any_rank(self.requested)
        return self.requested

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False


def save_checkpoint(path: Path, optimizer: AMPOptimizer, steps_done: int) -> None:
    """Write the run's state after ``steps_done`` optimizer steps to ``path``, whole: a
    temporary file beside it, then a rename (a crash never leaves half a checkpoint).
    Under data parallel, on every rank: a distributed checkpoint directory."""
    if optimizer.sharding is not None:
        extra = {"format": CHECKPOINT_FORMAT, "steps_done": steps_done}
        save_distributed(optimizer, path, extra)
        return
    state = {
        "format": CHECKPOINT_FORMAT,
        "steps_done": steps_done,
        "amp": optimizer.state_dict(),
        "cpu_rng": torch.get_rng_state(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: Path, optimizer: AMPOptimizer) -> int:
    """Restore what :func:`save_checkpoint` wrote into ``optimizer`` (and its module);
    returns the steps the saved run had done. ``ValueError`` for a file that is not such
    a checkpoint. A directory is a distributed checkpoint (saved on any number of ranks);
    a file, one process's, loads under data parallel too."""
    if path.is_dir():
        try:
            extra = load_distributed(optimizer, path)
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"cannot read checkpoint {str(path)!r}: {exc}") from None
        if extra.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"{str(path)!r} is not a checkpoint of this example (format {CHECKPOINT_FORMAT})"
            )
        return int(extra["steps_done"])
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise ValueError(f"cannot read checkpoint {str(path)!r}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"{str(path)!r} is not a checkpoint of this example (format {CHECKPOINT_FORMAT})"
        )
    # A whole optimizer state: under data parallel each rank takes its share of it.
    optimizer.load_state_dict(state["amp"], shard=True)
    torch.set_rng_state(state["cpu_rng"])
    return int(state["steps_done"])


__all__ = ["CHECKPOINT_FORMAT", "StopOnInterrupt", "load_checkpoint", "save_checkpoint"]
