"""Dynamic loss scaling inside the compiled step (fp16 training).

The step seeds the backward with the current scale instead of 1, so every gradient comes out
multiplied by it; the optimizer phase then unscales the gradients, checks them for inf/NaN and,
when any is found, keeps the old parameters and optimizer state (the update is skipped) and
backs the scale off; after `interval` clean steps in a row the scale grows. The whole decision
is made with tensor ops in the graph — no `.item()`, no host synchronisation — and follows
`torch.amp.GradScaler` exactly (same defaults, same update rule, same unscale arithmetic).

The scale and the growth tracker are step inputs and outputs (`Role.SCALER`); the Trainer keeps
them and saves/restores them with `Trainer.state_dict()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, MutableMapping

import torch
from torch import Tensor

from glmc.errors import ConfigError

SCALE = "loss_scale"
TRACKER = "growth_tracker"


@dataclass(frozen=True)
class LossScaling:
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ConfigError(f"loss scaling: init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ConfigError(f"loss scaling: growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError("loss scaling: backoff_factor must be in (0, 1), got "
                              f"{self.backoff_factor}")
        if self.growth_interval < 1:
            raise ConfigError("loss scaling: growth_interval must be >= 1, got "
                              f"{self.growth_interval}")

    def initial_state(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        return {SCALE: torch.full((), self.init_scale, dtype=torch.float32, device=device),
                TRACKER: torch.zeros((), dtype=torch.int32, device=device)}


def unscale(grads: list[Tensor], scale: Tensor) -> tuple[list[Tensor], Tensor]:
    """Gradients divided by the scale (as GradScaler: times the fp32 reciprocal computed in
    fp64) and one boolean scalar: did any gradient hold inf or NaN."""
    inv = scale.double().reciprocal().float()
    out = [g * inv.to(g.dtype) for g in grads]
    finite = torch.stack([torch.isfinite(g).all() for g in out]).all()
    return out, torch.logical_not(finite)


def unscale_each(grads: MutableMapping[Any, Tensor], scale: Tensor) -> Tensor:
    """`unscale` in place of `grads`' entries, one gradient at a time (each replaced as soon as
    it is divided, so one extra gradient is live, not a copy of all of them); returns the
    boolean found-inf scalar. The pipeline runtime's form (`PipelineTrainer`)."""
    found = torch.zeros((), dtype=torch.bool, device=scale.device)
    for k in list(grads):
        (grads[k],), bad = unscale([grads[k]], scale)
        found |= bad
    return found


def update(scale: Tensor, tracker: Tensor, found_inf: Tensor,
           cfg: LossScaling) -> tuple[Tensor, Tensor]:
    """`torch._amp_update_scale_` as tensor ops: back off on overflow, grow after N clean steps."""
    clean = tracker + 1
    grow = clean >= cfg.growth_interval
    grown = scale * cfg.growth_factor
    grown = torch.where(torch.isfinite(grown), grown, scale)
    new_scale = torch.where(found_inf, scale * cfg.backoff_factor,
                            torch.where(grow, grown, scale))
    zero = torch.zeros_like(tracker)
    new_tracker = torch.where(found_inf, zero, torch.where(grow, zero, clean))
    return new_scale, new_tracker


def skip_if(found_inf: Tensor, old: Tensor, new: Tensor) -> Tensor:
    """`old` where the step overflowed, else `new` (an update that is skipped leaves state)."""
    return torch.where(found_inf, old, new)
