"""The benchmark shapes (benchmarks/shapes.json), one named set at a time: ``shape_set("moe")`` is
the list of MoE cases in file order, ``shapes_by_name("moe")`` the same keyed by name."""
from __future__ import annotations

import json
import os

SHAPES_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes.json")


def shape_set(name: str) -> list[dict]:
    with open(SHAPES_JSON) as f:
        sets = json.load(f)
    if name not in sets:
        raise KeyError(f"benchmarks/shapes.json has no set {name!r}; it has {sorted(sets)}")
    return sets[name]


def shapes_by_name(name: str) -> dict[str, dict]:
    return {s["name"]: s for s in shape_set(name)}
