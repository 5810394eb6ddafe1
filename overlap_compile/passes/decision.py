"""What ``decide`` hands out and ``host_pacing`` revises: a site's ``Decision``, and the bar a
rewrite's predicted gain must clear (``required_gain``) and the time it must save
(``saves_too_little``). The candidates a decision weighs are the
predictor's ``Candidate`` (its ranking hands them out)."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import Options
from ..predictor import Candidate
from .matches import Match

BASELINE = "baseline"


@dataclasses.dataclass
class Decision:
    match: Match
    template: str
    config: dict | None
    reason: str
    candidates: list[Candidate]
    # host-launched graphs (passes/host_pacing.py): the site on the simulated clocks, in ms:
    # host_start/host_end (its host work), gpu_start/gpu_end, lead (GPU work queued ahead)
    host_clock: dict | None = None
    # search="measure": the site as written and the rewrite the decision weighed (the chosen one,
    # else the best predicted), each measured once on the group: baseline_ms, template, config,
    # ms, predicted_gain, measured_gain (or "note": why it was not measured)
    measured: dict | None = None

    @property
    def rewrites(self) -> bool:
        return self.template != BASELINE


def required_gain(options: Options, profile: Any, mode: str | None = None) -> float:
    """The predicted speedup a rewrite needs in ``mode`` (default: the current launch mode):
    min_speedup x (1 + the profile's model error there)."""
    return options.min_speedup * (1.0 + model_error(profile, mode))


def saves_too_little(base_ms: float, ms: float, options: Options) -> bool:
    """A rewrite of ``ms`` over ``base_ms`` (both per call) saves under ``min_saved_us``."""
    return (base_ms - ms) * 1e3 < options.min_saved_us


def model_error(profile: Any, mode: str | None = None) -> float:
    """The profile's measured mean |error| of template predictions in ``mode`` (default: the
    current launch mode; ``model_error``, from benchmarks/fitting/predictor_replay.py): a predicted gain
    must clear min_speedup by that much too, or a rewrite the model is merely optimistic about
    could lose."""
    if profile is None:
        return 0.0
    from ..predictor import launch_mode

    table = getattr(profile, "raw", {}).get("model_error", {})
    return float(table.get(mode or launch_mode(), 0.0))
