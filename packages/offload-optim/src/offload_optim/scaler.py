"""Dynamic loss scale with hysteresis, for fp16 training."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)


class DynamicLossScaler:
    """The loss scale of fp16 training and its update rule.

    After a step without overflow the scale grows by ``growth_factor`` once
    ``growth_interval`` consecutive steps have had finite gradients. An overflow (inf or nan
    in any gradient) resets that count; it backs the scale off by ``backoff_factor`` only
    from the ``hysteresis``-th overflow since the scale last grew (or since the start)
    onwards, so one stray overflow costs a skipped step but not a halved scale. This is the
    rule of Megatron-LM's and Colossal-AI's dynamic grad scalers. The scale stays within
    ``[min_scale, max_scale]``.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**32,
    ) -> None:
        if not (min_scale > 0 and min_scale <= max_scale and math.isfinite(max_scale)):
            raise ValueError(
                f"loss scale bounds min_scale={min_scale}, max_scale={max_scale}: need "
                "0 < min_scale <= max_scale < inf"
            )
        if not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                f"initial_scale={initial_scale} lies outside [min_scale={min_scale}, "
                f"max_scale={max_scale}]; pick an initial scale inside the bounds"
            )
        if not growth_factor > 1:
            raise ValueError(f"growth_factor={growth_factor} must be > 1 (2 is usual)")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor={backoff_factor} must lie in (0, 1) (0.5 is usual)")
        if growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval} must be >= 1 step")
        if hysteresis < 1:
            raise ValueError(f"hysteresis={hysteresis} must be >= 1 overflow")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.scale = float(initial_scale)
        """The factor the loss is multiplied by before backward."""
        self.good_steps = 0
        """Consecutive steps with finite gradients since the last overflow or growth."""
        self.overflows = 0
        """Overflows since the scale last grew."""

    def update(self, overflow: bool) -> None:
        """Account one optimizer step; ``overflow`` says whether its gradients overflowed."""
        if overflow:
            self.good_steps = 0
            self.overflows += 1
            if self.overflows >= self.hysteresis:
                old = self.scale
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                log.info("gradient overflow: loss scale %g -> %g", old, self.scale)
            else:
                log.info(
                    "gradient overflow: step skipped, loss scale kept at %g (hysteresis %d/%d)",
                    self.scale,
                    self.overflows,
                    self.hysteresis,
                )
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.good_steps = 0
            self.overflows = 0
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "overflows": self.overflows,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scale, its counters and its settings from :meth:`state_dict`."""
        try:
            self.scale = float(state["scale"])
            self.good_steps = int(state["good_steps"])
            self.overflows = int(state["overflows"])
        except KeyError as exc:
            raise ValueError(
                f"loss scaler state is missing {exc}; pass what DynamicLossScaler.state_dict "
                "returned"
            ) from exc
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            if key in state:
                setattr(self, key, float(state[key]))
        for key in ("growth_interval", "hysteresis"):
            if key in state:
                setattr(self, key, int(state[key]))
