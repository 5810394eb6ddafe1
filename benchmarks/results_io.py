"""Where the benchmarks write their rows: one naming rule and one writer for every results file.

    path = write_rows(rows, out, "ops", device, world)
    # -> <out>/ops-<device>-w<world>-torch<version>-<date>.json

Rows follow DESIGN.md's schema ("Benchmark results: one schema"); this module only names and
writes the file, it never changes a row. The device name has its spaces replaced by "_", the torch
version loses its local part ("2.11.0+cu130" -> "2.11.0"), the date is ISO. ``result_stem`` gives
the same path without ".json", for the files a benchmark writes beside its rows (a markdown table,
PNGs, a text summary); ``suffix`` tells runs of one day apart (e.g. gemm.py's "-flat").
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Callable


def device_tag(device: str) -> str:
    """The device name as it appears in file names ("NVIDIA H200" -> "NVIDIA_H200")."""
    return device.replace(" ", "_")


def torch_tag(version: str | None = None) -> str:
    """The torch version without its local part ("2.11.0+cu130" -> "2.11.0")."""
    if version is None:
        import torch

        version = torch.__version__
    return version.split("+")[0]


def result_stem(out: str, benchmark: str, device: str, world: int, torch_version: str | None = None,
                date: str | None = None, suffix: str = "") -> str:
    """``<out>/<benchmark>-<device>-w<world>-torch<v>-<date><suffix>`` (no extension)."""
    date = date or datetime.date.today().isoformat()
    name = f"{benchmark}-{device_tag(device)}-w{world}-torch{torch_tag(torch_version)}-{date}{suffix}"
    return os.path.join(out, name)


def write_rows(rows: list[dict], out: str, benchmark: str, device: str, world: int,
               torch_version: str | None = None, date: str | None = None, suffix: str = "",
               default: Callable[[Any], Any] | None = None, table: str | None = None) -> str:
    """Write ``rows`` as a JSON list (indent 1) to ``result_stem(...) + ".json"``, creating ``out``
    if needed; returns the path. ``default``: json.dump's hook for values JSON cannot hold;
    ``table``: a markdown table of them, written beside (``.md``)."""
    stem = result_stem(out, benchmark, device, world, torch_version, date, suffix)
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(rows, f, indent=1, default=default)
    if table is not None:
        with open(stem + ".md", "w") as f:
            f.write(table)
    return stem + ".json"


def run_file(out: str, benchmark: str, run_id: str, what: str) -> str:
    """Rank 0's running record of a run: 'partial' (each finished row, JSON lines, so a run that
    is stopped or dies keeps what it measured), 'inflight' (the configuration being measured)."""
    return os.path.join(out, f"{benchmark}-{what}-{run_id}." + ("jsonl" if what == "partial" else "json"))
