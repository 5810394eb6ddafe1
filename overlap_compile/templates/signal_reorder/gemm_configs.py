"""signal_reorder's GEMM tile configurations: the meta-parameters of gemm_kernel._gemm_kernel
(``GemmConfig``), the ones worth timing on Hopper, a heuristic default, and the tuned choice per
shape, cached in memory and (when benchmarks/gemm.py tuned them) in a JSON file
(``OVERLAP_COMPILE_GEMM_CACHE``). tile_fused, priority_stream and the profile command use them too
(through kernels.py, which re-exports them).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading

import torch


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Meta-parameters of _gemm_kernel. block_m/block_n/group_m are fixed by a plan when the
    GEMM feeds signal_reorder (they define the layout); the rest is free to tune."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    flatten: bool = True
    warp_specialize: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "GemmConfig":
        names = {f.name for f in dataclasses.fields(GemmConfig)}
        return GemmConfig(**{k: v for k, v in d.items() if k in names})


def candidate_configs(dtype: torch.dtype) -> list[GemmConfig]:
    """Configs worth timing on Hopper (DESIGN.md: 128x256x64, 3 stages, 8 warps is the anchor;
    4 stages at 128x256 exceed shared memory)."""
    if dtype == torch.float32:
        return [GemmConfig(128, 128, 32, 8, 3, 8), GemmConfig(128, 256, 32, 8, 3, 8)]
    return [
        GemmConfig(128, 256, 64, 8, 3, 8, True, False),
        GemmConfig(128, 256, 64, 8, 3, 8, True, True),
        GemmConfig(256, 128, 64, 8, 3, 8, True, False),
        GemmConfig(128, 128, 64, 8, 4, 8, True, False),
    ]


def default_config(dtype: torch.dtype, block_m: int | None = None, block_n: int | None = None,
                   group_m: int | None = None) -> GemmConfig:
    """A safe heuristic when nothing was tuned: 64-wide K steps, as many stages as shared
    memory allows for the tile (fp32 operands: 32-wide K steps)."""
    bm = block_m or 128
    bn = block_n or 256
    bk = 32 if dtype == torch.float32 else 64
    item = 4 if dtype == torch.float32 else 2
    stage_bytes = (bm + bn) * bk * item
    epilogue = bm * bn * item
    # Hopper gives a block up to 227 KiB of shared memory; a tighter budget leaves 128x256x64 bf16
    # only 2 stages, far slower than 3.
    stages = max(2, min(4, (227 * 1024 - epilogue) // max(stage_bytes, 1)))
    warps = 8 if bm * bn >= 128 * 128 else 4
    return GemmConfig(bm, bn, bk, group_m or 8, int(stages), warps, True, False)


_cache_lock = threading.Lock()
_tuned: dict[str, dict] | None = None  # key -> {"best": cfg dict, "timings": [[cfg dict, ms], ...]}


def cache_path() -> str:
    """Where tuned configs persist: $OVERLAP_COMPILE_GEMM_CACHE or ~/.cache/overlap_compile/."""
    return os.environ.get("OVERLAP_COMPILE_GEMM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "overlap_compile", "gemm_configs.json")


def _cache() -> dict[str, dict]:
    global _tuned
    with _cache_lock:
        if _tuned is None:
            _tuned = {}
            try:
                with open(cache_path()) as f:
                    data = json.load(f)
                if isinstance(data, dict):
                    _tuned = data
            except (OSError, ValueError):
                pass
        return _tuned


def _save_cache() -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(_cache(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent ranks never read half a file
    except OSError:
        pass  # a read-only home only loses persistence, not correctness


def _shape_key(device: torch.device, m: int, n: int, k: int, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{name}|{str(dtype).replace('torch.', '')}|{m}x{n}x{k}"


def choose_config(device: torch.device, m: int, n: int, k: int, dtype: torch.dtype,
                  block_m: int | None = None, block_n: int | None = None,
                  group_m: int | None = None) -> GemmConfig:
    """The tuned config for this shape (restricted to the given block sizes, if any), else the
    heuristic default."""
    entry = _cache().get(_shape_key(device, m, n, k, dtype))
    if entry:
        if block_m is None and block_n is None:
            cfg = GemmConfig.from_dict(entry["best"])
            return dataclasses.replace(cfg, group_m=group_m or cfg.group_m)
        fits = [(ms, c) for c, ms in entry.get("timings", [])
                if c.get("block_m") == block_m and c.get("block_n") == block_n and ms is not None]
        if fits:
            cfg = GemmConfig.from_dict(min(fits, key=lambda x: x[0])[1])
            return dataclasses.replace(cfg, group_m=group_m or cfg.group_m)
    return default_config(dtype, block_m, block_n, group_m)


def preferred_blocks(device: torch.device, m: int, n: int, k: int, dtype: torch.dtype) -> tuple[int, int]:
    """(block_m, block_n) the spec should put into a plan for this GEMM on this device."""
    cfg = choose_config(device, m, n, k, dtype)
    return cfg.block_m, cfg.block_n
