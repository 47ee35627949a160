"""Where hardware profiles are cached, and reading and writing them.

[Note: hardware cache]
Profiles live in :func:`default_cache_dir` (``$OFFLOAD_CACHE_DIR``, else
``$XDG_CACHE_HOME/offload``, else ``~/.cache/offload``), one ``HardwareProfile.to_json``
document per file:

- ``hardware-<format>-<identity key>-<dtype>.json``: the device-level measurements (copy
  sweep, peak matmul rate, Adam rates and every host step's rate, host conversion rate,
  host and device memory bandwidth, copy contention, per-operation issue cost) with
  ``DEFAULT_COMPUTE_EFFICIENCY``;
- ``hardware-<format>-<identity key>-<dtype>-mm<digest>.json``: the same with the
  efficiency measured on one set of matrix shapes and, where the model has fused
  attention, attention's rates at its shapes (the digest covers both). A new model only
  costs the matmul and attention timing (about a second for a few shapes), not a new copy
  sweep and the host probes (a few seconds, more in a process that has not built a torch
  optimizer yet: that lazily imports ``torch._dynamo``). Every plan of one model on one
  machine then prices its products and its attention alike, whether planned from the
  model or from a copy on the meta device.

The identity key (``DeviceIdentity.cache_key``) names the GPU model, its UUID (or PCI
bus id) and the torch version, so a different card, or a torch upgrade that may change the
kernels, gets a fresh profile. ``<format>`` (:data:`CACHE_FORMAT`) changes when a
profile gains a measurement, so that older files, which lack it, are measured again
rather than read with the field's "unknown" default, and when a probe changes what it
measures. ``profile_hardware(..., force=True)`` re-measures the device-level file,
overwrites it, and removes the shape files built on the one it replaces (they copy its
measurements); an unreadable file is re-measured with a warning.

The cache's location is the only thing the library reads from the environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from offload_solver import HardwareProfile, write_atomic

__all__ = [
    "CACHE_FORMAT",
    "AttentionKeys",
    "CacheFiles",
    "cache_files",
    "default_cache_dir",
    "load_cached",
    "store",
]

CACHE_FORMAT = "p8"
"""Version of what a cached profile measures, part of its file name. It changes whenever a
probe is added or changes what it measures, so that files of another version are not
read but measured again."""
CACHE_DIR_ENV = "OFFLOAD_CACHE_DIR"

MatmulCounts = tuple[tuple[tuple[int, int, int], int], ...]
"""Distinct matrix-product shapes ``(m, k, n)`` with how often each occurs, sorted."""
AttentionKeys = tuple[tuple[int, int, int, int, float, int], ...]
"""Fused attention shapes ``(batch, heads, seq, head_dim, dropout_p, calls)``, sorted."""


def default_cache_dir() -> Path:
    """``$OFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/offload``, else ``~/.cache/offload``."""
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return Path(xdg).expanduser() / "offload"
    return Path.home() / ".cache" / "offload"


@dataclass(frozen=True)
class CacheFiles:
    """The cache files of one device and dtype (:func:`cache_files`)."""

    folder: Path
    stem: str
    """``hardware-<format>-<identity key>-<dtype>``."""
    shapes_digest: str | None
    """Digest of the set of matrix and attention shapes; ``None`` without shapes."""

    @property
    def base(self) -> Path:
        """The device-level profile."""
        return self.folder / f"{self.stem}.json"

    @property
    def shapes(self) -> Path | None:
        """The profile with the efficiency of the set of shapes, or ``None`` without shapes."""
        if self.shapes_digest is None:
            return None
        return self.folder / f"{self.stem}-mm{self.shapes_digest}.json"

    def drop_shape_files(self) -> None:
        """Remove every shape file built on this device-level file (any set of shapes)."""
        for path in self.folder.glob(f"{self.stem}-mm*.json"):
            with contextlib.suppress(OSError):
                path.unlink()


def cache_files(
    folder: Path | None,
    identity_key: str,
    dtype_name: str,
    shapes: MatmulCounts,
    attention: AttentionKeys = (),
) -> CacheFiles:
    """The cache files of a device (``identity_key``) and dtype in ``folder`` (default
    :func:`default_cache_dir`)."""
    return CacheFiles(
        folder=folder if folder is not None else default_cache_dir(),
        stem=f"hardware-{CACHE_FORMAT}-{identity_key}-{dtype_name}",
        shapes_digest=_shapes_digest(shapes, attention) if shapes or attention else None,
    )


def _shapes_digest(shapes: MatmulCounts, attention: AttentionKeys) -> str:
    doc: list[object] = [[list(s), c] for s, c in shapes]
    if attention:  # a file without attention keeps the digest it had before
        doc.append({"attention": [list(a) for a in attention]})
    text = json.dumps(doc)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_cached(path: Path) -> HardwareProfile | None:
    """The profile in ``path``; ``None`` (after a warning, if the file exists) when unusable."""
    if not path.exists():
        return None
    try:
        return HardwareProfile.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # ValueError covers bad JSON, a wrong schema version and undecodable bytes.
        warnings.warn(
            f"hardware profile cache {path} is unusable ({exc}); re-measuring and overwriting it",
            stacklevel=3,
        )
        return None


def store(path: Path, profile: HardwareProfile, say: Callable[[str], None]) -> None:
    """Write ``profile`` atomically: a reader never sees half a file, even with two writers."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, profile.to_json())
        say(f"cached at {path}")
    except OSError as exc:
        warnings.warn(
            f"could not write the hardware profile cache {path} ({exc}); the device will be "
            f"profiled again next time. Set {CACHE_DIR_ENV} to a writable folder to keep it.",
            stacklevel=3,
        )
