"""Merge profiles measured at different world sizes into one built-in profile.

    python benchmarks/fitting/merge_profiles.py measured-w2.json --add old-h200.json --gpus-per-node 8 --out h200.json

The first file is the base (GEMM table, contention, launch and op overheads, notes). Each
``--add`` file contributes the collective curves of world sizes the base lacks, recorded in the
notes with that file's own ``source``, so the result says which curve came from where.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository root


def merge(base: dict, others: list[dict], gpus_per_node: int | None) -> dict:
    out = copy.deepcopy(base)
    for other in others:
        added = []
        for coll, per_world in other["collectives"].items():
            mine = out["collectives"].setdefault(coll, {})
            for w, pts in per_world.items():
                if w not in mine:
                    mine[w] = pts
                    added.append(f"{coll}@{w}")
        if added:
            worlds = sorted({a.split("@")[1] for a in added}, key=int)
            out["notes"].append(f"collective curves at world size(s) {', '.join(worlds)} from a profile "
                                f"{other.get('source', '?')!r} (not re-measured: {len(added)} curves)")
    if gpus_per_node:
        out["topology"]["gpus_per_node"] = gpus_per_node
        out["notes"].append(f"topology.gpus_per_node = {gpus_per_node} (the node's size, not the measured world)")
    return out


def main() -> None:
    from overlap_compile.predictor.profile import save_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("--add", action="append", default=[])
    ap.add_argument("--gpus-per-node", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    load = lambda p: json.load(open(p, encoding="utf-8"))  # noqa: E731
    save_profile(merge(load(args.base), [load(p) for p in args.add], args.gpus_per_node), args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
