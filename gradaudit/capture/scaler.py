"""What a GradScaler knew during the step: loss scale, unscale_ before clipping, found_inf.

GradScaler keeps this in private per-optimizer state whose layout differs across torch versions, so
every read is defensive and an unreadable field is reported as unknown (None), never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ScalerWatch:
    def __init__(self, scaler: Any, optimizer: Any) -> None:
        self.scaler = scaler
        self.optimizer = optimizer
        self._states: Mapping[int, dict[str, Any]] | None = None

    @property
    def active(self) -> bool:
        if self.scaler is None:
            return False
        enabled = getattr(self.scaler, "is_enabled", None)
        return bool(enabled()) if callable(enabled) else True

    def scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.active else None

    def scale_unread(self) -> Any:
        """The loss scale now without reading it (`get_scale` waits for the device): a copy of the
        scaler's tensor, on its device (update() changes that tensor in place); a float before the
        scaler's first scale(), or where it keeps no tensor."""
        if not self.active:
            return None
        held = getattr(self.scaler, "_get_scale_async", lambda: None)()
        return float(self.scaler.get_scale()) if held is None else held.detach().clone()

    def hold(self) -> None:
        """Keep a reference to the per-optimizer states: update() replaces the dict, so found_inf
        stays readable from the held one after the user called update() inside the step."""
        states = getattr(self.scaler, "_per_optimizer_states", None) if self.active else None
        if states is not None:
            self._states = states

    def unscaled(self) -> bool | None:
        """Whether unscale_ had run for the optimizer (explicitly, or inside step())."""
        state = self._state(getattr(self.scaler, "_per_optimizer_states", None))
        if state is None:
            return None if not self.active or self.optimizer is None else False
        stage = state.get("stage")
        return getattr(stage, "name", None) in ("UNSCALED", "STEPPED")

    def found_inf(self) -> bool | None:
        state = self._state(self._states)
        per_device = state.get("found_inf_per_device") if state else None
        if not per_device:
            return None
        return any(float(v.sum()) > 0 for v in per_device.values())

    def _state(self, states: Mapping[int, dict[str, Any]] | None) -> dict[str, Any] | None:
        if not self.active or states is None:
            return None
        if self.optimizer is None:
            # No optimizer given (a framework that hooks its optimizer itself, e.g. AccelerateAudit):
            # a scaler that tracks exactly one optimizer can only mean that one.
            return next(iter(states.values())) if len(states) == 1 else None
        # .get, not [ ]: the dict is a defaultdict and must not grow an entry because we looked
        return states.get(id(self.optimizer))
