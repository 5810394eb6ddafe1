"""Latency predictor (issue #3 fills this in): hardware profiles and per-template models.

API used by passes.decide:
    load_profile(name_or_path) -> HardwareProfile | None
    predict_baseline(match, profile) -> float | None          (ms)
    rank_configs(spec, match, profile) -> list[Candidate]     (best first)
"""
from __future__ import annotations


def load_profile(name: str):
    return None


def predict_baseline(match, profile):
    return None


def rank_configs(spec, match, profile):
    return []
