"""HardwareProfile: what the predictor knows about a machine, as plain JSON (never pickle).

A profile file is one JSON object::

    {
      "format": 1,
      "name": "h200",                      # goes into the Report (GraphRecord.profile)
      "gpu": "NVIDIA H200",
      "source": "...",                     # how it was made (the command, or "seeded from ANCHORS.md ...")
      "provisional": false,                # true: estimates; re-measure with `python -m overlap_compile profile`
      "roofline_only": false,              # true: made from device properties, nothing measured
      "sm_count": 132, "smem_per_sm": 233472, "regs_per_sm": 65536, "max_blocks_per_sm": 32,
      "gemm": {
        "peak_tflops": {"bfloat16": 989.0, ...},     # dense tensor-core peak per dtype
        "efficiency":  {"bfloat16": 0.74, ...},      # achieved / peak on large GEMMs (roofline fallback)
        "mem_gbps": 4800.0,                           # HBM bandwidth for the memory side of the roofline
        "floor_ms": 0.006,                            # no GEMM launch takes less
        "table": [{"m": 8192, "n": 8192, "k": 4096, "dtype": "bfloat16", "config": null, "ms": 0.75}, ...],
                  # config null: cuBLAS (torch.mm); a string: one of "kernels" below (a Triton kernel)
        "kernels": [{"name": "128x256", "block_m": 128, "block_n": 256, "block_k": 64, "stages": 3,
                     "warps": 8, "regs_per_thread": 232, "vs_cublas": 0.95}, ...]
                  # the template GEMM kernels: blocks/SM follow from smem and registers; vs_cublas is
                  # their speed relative to cuBLAS where the table has no entry for them
      },
      "collectives": {                     # per collective, per world size: [[bytes, ms], ...], sizes ascending
        "all_reduce": {"4": [[65536, 0.025], ..., [536870912, 2.51]]},
        "reduce_scatter": {...}, "all_gather": {...}, "all_to_all": {...},
        "p2p": {...},                      # NCCL send/recv, every rank sending `bytes` to one peer at once
        "copy_engine": {...}               # peer copy through the copy engines (no SMs), same convention
      },
      "nccl_sms": {"all_reduce": 24, ...}, # SMs NCCL kernels occupy while they run
      "launch_ms": {"eager": 0.015, "cuda_graph": 0.002},   # per collective call, on top of the curve
      "contention": {"gemm_slowdown": 1.12,          # a full-grid GEMM next to a collective
                     "gemm_slowdown_reserved": 1.03, # a persistent GEMM that leaves NCCL's SMs free
                     "comm_slowdown": 1.08},         # a collective next to a GEMM
      "topology": {"gpus_per_node": 4, "peer_access": true, "inter_node_gbps": 50.0, "inter_node_latency_ms": 0.02}
    }

Curve bytes as nccl-tests' "size": all_reduce = the buffer; reduce_scatter = its input; all_gather
= its output; all_to_all = the buffer one rank sends; p2p / copy_engine = bytes to one peer. Loading
validates everything and raises ``ProfileError`` (file, field, problem); never a silent default.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from typing import Any

from .curves import Curve, traffic_factor
from .gemm_table import GemmModel, Kernel

FORMAT = 1
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p", "copy_engine")
LAUNCH_MODES = ("eager", "cuda_graph")
BUILTIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
KiB, MiB = 1024, 1024 * 1024
# Sampled message sizes of the collective curves: 64 KiB ... 512 MiB, powers of two.
SAMPLE_MIN, SAMPLE_MAX = 64 * KiB, 512 * MiB


class ProfileError(ValueError):
    """A profile file or object is missing, malformed or incomplete (the message says where)."""


def sample_sizes(lo: int = SAMPLE_MIN, hi: int = SAMPLE_MAX) -> list[int]:
    """Message sizes a profile samples: powers of two from ``lo`` to ``hi`` bytes."""
    if lo <= 0 or hi < lo:
        raise ValueError(f"sample_sizes: need 0 < lo <= hi, got {lo}, {hi}")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpu: str
    source: str
    sm_count: int
    smem_per_sm: int
    regs_per_sm: int
    max_blocks_per_sm: int
    gemm: GemmModel
    curves: dict[str, dict[int, Curve]]
    nccl_sms: dict[str, int]
    launch_ms: dict[str, float]
    contention: dict[str, float]
    topology: dict[str, Any]
    provisional: bool = False
    roofline_only: bool = False
    path: str | None = None  # file it came from
    raw: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    # -- identity --------------------------------------------------------------------------
    @functools.cached_property
    def digest(self) -> str:
        """Hash of the profile's content: part of the decision cache key (two files may share a name).
        Computed once: a profile is read-only once built."""
        text = json.dumps(self.raw, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest}"

    # -- collectives ------------------------------------------------------------------------
    def comm_ms(self, collective: str, nbytes: float, world: int, cross_node: bool = False) -> float:
        """Time of one ``collective`` call moving ``nbytes`` (curve convention) among ``world`` ranks.

        A world size the profile did not sample takes the nearest sampled one and scales the
        part above the latency floor by the ring traffic factor. A group spanning nodes is
        limited by the inter-node bandwidth of ``topology``.
        """
        if collective not in self.curves:
            raise KeyError(f"profile {self.name!r} has no curve for collective {collective!r}")
        per_world = self.curves[collective]
        if world in per_world:
            t = per_world[world](nbytes)
        else:
            w0 = min(per_world, key=lambda w: (abs(math.log2(max(w, 1)) - math.log2(max(world, 1))), w))
            c = per_world[w0]
            floor = c.ms[0]
            scale = traffic_factor(collective, world) / traffic_factor(collective, w0)
            t = floor + max(0.0, c(nbytes) - floor) * scale
        if cross_node:
            gbps = float(self.topology.get("inter_node_gbps", 25.0))
            lat = float(self.topology.get("inter_node_latency_ms", 0.02))
            t = max(t, lat + traffic_factor(collective, world) * nbytes / (gbps * 1e9) * 1e3)
        return t

    def launch(self, mode: str) -> float:
        return self.launch_ms.get(mode, self.launch_ms["eager"])

    def sms_of(self, collective: str) -> int:
        return int(self.nccl_sms.get(collective, 0))

    @property
    def gpus_per_node(self) -> int:
        return int(self.topology.get("gpus_per_node", 8))

    @property
    def peer_access(self) -> bool:
        return bool(self.topology.get("peer_access", False))

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dict(self.raw)

    def save(self, path: str) -> None:
        save_profile(self.raw, path)


# ---- validation ---------------------------------------------------------------------------


class _Check:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> None:
        raise ProfileError(f"profile {self.source}: {where}: {problem}")

    def get(self, obj: dict, key: str, where: str) -> Any:
        if not isinstance(obj, dict):
            self.fail(where or "<top>", f"expected a JSON object, got {type(obj).__name__}")
        if key not in obj:
            self.fail(f"{where}.{key}" if where else key, "missing field")
        return obj[key]

    def number(self, obj: dict, key: str, where: str, positive: bool = True, allow_zero: bool = False) -> float:
        v = self.get(obj, key, where)
        path = f"{where}.{key}" if where else key
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.fail(path, f"expected a number, got {v!r}")
        if positive and (v < 0 or (v == 0 and not allow_zero)):
            self.fail(path, f"expected a number {'>= 0' if allow_zero else '> 0'}, got {v!r}")
        return float(v)

    def integer(self, obj: dict, key: str, where: str, minimum: int = 1) -> int:
        v = self.get(obj, key, where)
        path = f"{where}.{key}" if where else key
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.fail(path, f"expected an integer >= {minimum}, got {v!r}")
        return v

    def string(self, obj: dict, key: str, where: str) -> str:
        v = self.get(obj, key, where)
        if not isinstance(v, str) or not v:
            self.fail(f"{where}.{key}" if where else key, f"expected a non-empty string, got {v!r}")
        return v

    def mapping(self, obj: dict, key: str, where: str) -> dict:
        v = self.get(obj, key, where)
        if not isinstance(v, dict):
            self.fail(f"{where}.{key}" if where else key, f"expected a JSON object, got {type(v).__name__}")
        return v


def profile_from_dict(d: Any, source: str = "<dict>", path: str | None = None) -> HardwareProfile:
    """Validate a profile object (as read from JSON) and build the HardwareProfile."""
    c = _Check(source)
    if not isinstance(d, dict):
        c.fail("<top>", f"expected a JSON object, got {type(d).__name__}")
    fmt = c.integer(d, "format", "")
    if fmt != FORMAT:
        c.fail("format", f"unsupported format {fmt} (this overlap_compile reads format {FORMAT})")
    name = c.string(d, "name", "")
    gpu = c.string(d, "gpu", "")
    src = c.string(d, "source", "")
    sm_count = c.integer(d, "sm_count", "")
    smem = c.integer(d, "smem_per_sm", "")
    regs = c.integer(d, "regs_per_sm", "")
    max_blocks = c.integer(d, "max_blocks_per_sm", "")
    for flag in ("provisional", "roofline_only"):
        if flag in d and not isinstance(d[flag], bool):
            c.fail(flag, f"expected true or false, got {d[flag]!r}")

    g = c.mapping(d, "gemm", "")
    peak = c.mapping(g, "peak_tflops", "gemm")
    eff = c.mapping(g, "efficiency", "gemm")
    if not peak:
        c.fail("gemm.peak_tflops", "needs at least one dtype")
    if not eff:
        c.fail("gemm.efficiency", "needs at least one dtype")
    peak = {k: c.number(peak, k, "gemm.peak_tflops") for k in peak}
    effs = {k: c.number(eff, k, "gemm.efficiency") for k in eff}
    for k, v in effs.items():
        if v > 1:
            c.fail(f"gemm.efficiency.{k}", f"an efficiency is a fraction of peak (<= 1), got {v}")
    mem = c.number(g, "mem_gbps", "gemm")
    floor = c.number(g, "floor_ms", "gemm", allow_zero=True)
    kernels = []
    kl = c.get(g, "kernels", "gemm")
    if not isinstance(kl, list):
        c.fail("gemm.kernels", f"expected a list, got {type(kl).__name__}")
    for i, kd in enumerate(kl):
        w = f"gemm.kernels[{i}]"
        kw = dict(name=c.string(kd, "name", w), block_m=c.integer(kd, "block_m", w),
                  block_n=c.integer(kd, "block_n", w))
        for key in ("block_k", "stages", "warps", "regs_per_thread", "smem_bytes"):
            if key in kd:
                kw[key] = c.integer(kd, key, w)
        if "vs_cublas" in kd:
            kw["vs_cublas"] = c.number(kd, "vs_cublas", w)
        kernels.append(Kernel(**kw))
    names = [k.name for k in kernels]
    if len(set(names)) != len(names):
        c.fail("gemm.kernels", f"kernel names must be unique, got {names}")
    table = []
    tl = c.get(g, "table", "gemm")
    if not isinstance(tl, list):
        c.fail("gemm.table", f"expected a list, got {type(tl).__name__}")
    for i, e in enumerate(tl):
        w = f"gemm.table[{i}]"
        cfg = e.get("config") if isinstance(e, dict) else None
        if cfg is not None and cfg not in names:
            c.fail(f"{w}.config", f"{cfg!r} is not a kernel of gemm.kernels ({names}) nor null (cuBLAS)")
        dt = c.string(e, "dtype", w)
        table.append((c.integer(e, "m", w), c.integer(e, "n", w), c.integer(e, "k", w), dt, cfg, c.number(e, "ms", w)))
    gemm = GemmModel(peak, effs, mem, floor, tuple(table), tuple(kernels))

    coll = c.mapping(d, "collectives", "")
    curves: dict[str, dict[int, Curve]] = {}
    for name_c in COLLECTIVES:
        per = c.mapping(coll, name_c, "collectives")
        if not per:
            c.fail(f"collectives.{name_c}", "needs at least one world size")
        curves[name_c] = {}
        for wkey, pts in per.items():
            w = f"collectives.{name_c}.{wkey}"
            try:
                world = int(wkey)
            except ValueError:
                c.fail(w, f"world size keys are integers as strings, got {wkey!r}")
            if world < 1:
                c.fail(w, f"world size must be >= 1, got {world}")
            if not isinstance(pts, list) or not pts:
                c.fail(w, "expected a non-empty list of [bytes, ms] pairs")
            last = 0
            parsed = []
            for j, p in enumerate(pts):
                numbers = isinstance(p, list) and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in p)
                if not numbers or len(p) != 2:
                    c.fail(f"{w}[{j}]", f"expected [bytes, ms], got {p!r}")
                b, t = p
                if b <= last:
                    c.fail(f"{w}[{j}]", f"sizes must be positive and strictly ascending ({b} after {last})")
                if not t > 0 or not math.isfinite(t):
                    c.fail(f"{w}[{j}]", f"time must be > 0 ms, got {t!r}")
                last = b
                parsed.append((int(b), float(t)))
            curves[name_c][world] = Curve.from_points(parsed)
    unknown = set(coll) - set(COLLECTIVES)
    if unknown:
        c.fail("collectives", f"unknown collectives {sorted(unknown)}; known: {list(COLLECTIVES)}")

    sms_d = c.mapping(d, "nccl_sms", "")
    nccl_sms = {}
    for k_, v in sms_d.items():
        if k_ not in COLLECTIVES:
            c.fail(f"nccl_sms.{k_}", f"unknown collective; known: {list(COLLECTIVES)}")
        nccl_sms[k_] = c.integer(sms_d, k_, "nccl_sms", minimum=0)
        if nccl_sms[k_] >= sm_count:
            c.fail(f"nccl_sms.{k_}", f"NCCL cannot take all {sm_count} SMs, got {nccl_sms[k_]}")
    launch_d = c.mapping(d, "launch_ms", "")
    launch = {m: c.number(launch_d, m, "launch_ms", allow_zero=True) for m in LAUNCH_MODES}
    cont_d = c.mapping(d, "contention", "")
    contention = {}
    for key in ("gemm_slowdown", "gemm_slowdown_reserved", "comm_slowdown"):
        v = c.number(cont_d, key, "contention")
        if v < 1:
            c.fail(f"contention.{key}", f"a slowdown factor is >= 1, got {v}")
        contention[key] = v
    topo = c.mapping(d, "topology", "")
    c.integer(topo, "gpus_per_node", "topology")
    if not isinstance(c.get(topo, "peer_access", "topology"), bool):
        c.fail("topology.peer_access", f"expected true or false, got {topo['peer_access']!r}")
    for key in ("inter_node_gbps", "inter_node_latency_ms"):
        if key in topo:
            c.number(topo, key, "topology")
    return HardwareProfile(
        name=name, gpu=gpu, source=src, sm_count=sm_count, smem_per_sm=smem, regs_per_sm=regs,
        max_blocks_per_sm=max_blocks, gemm=gemm, curves=curves, nccl_sms=nccl_sms, launch_ms=launch,
        contention=contention, topology=dict(topo), provisional=bool(d.get("provisional", False)),
        roofline_only=bool(d.get("roofline_only", False)), path=path, raw=d,
    )


# ---- files -----------------------------------------------------------------------------------


def read_profile(path: str) -> HardwareProfile:
    """Load and validate a profile JSON file; errors name the path and the problem."""
    if not os.path.exists(path):
        raise ProfileError(f"profile {path}: file does not exist")
    if os.path.isdir(path):
        raise ProfileError(f"profile {path}: is a directory, expected a JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileError(f"profile {path}: cannot read: {e}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    return profile_from_dict(d, source=path, path=path)


def save_profile(d: dict, path: str) -> None:
    """Validate ``d`` and write it as JSON (atomically: a temp file renamed into place)."""
    profile_from_dict(d, source=path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def builtin_names() -> list[str]:
    if not os.path.isdir(BUILTIN_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(BUILTIN_DIR) if f.endswith(".json"))


def builtin_path(name: str) -> str:
    return os.path.join(BUILTIN_DIR, f"{name}.json")


# ---- "auto" ----------------------------------------------------------------------------------

# bf16 dense tensor-core FLOP per clock per SM, by compute capability major (roofline of unknown GPUs)
_FLOP_PER_CLK_SM = {7: 1024, 8: 2048, 9: 4096, 10: 8192, 12: 2048}


def roofline_profile(props: Any, name: str | None = None) -> dict:
    """A profile dict from CUDA device properties alone (``torch.cuda.get_device_properties``),
    marked ``roofline_only``: GEMMs from the tensor-core peak at an assumed 1.6 GHz and 70%
    efficiency; collectives from a generic interconnect (NVLink-class when peer access is
    likely, i.e. the name says SXM/NVL/HGX, else PCIe-class). Replace it with a measured one."""
    gpu = str(getattr(props, "name", "unknown GPU"))
    sms = int(getattr(props, "multi_processor_count", 80) or 80)
    major = int(getattr(props, "major", 8) or 8)
    smem = int(getattr(props, "shared_memory_per_multiprocessor", 0) or (228 if major >= 9 else 164) * KiB)
    regs = int(getattr(props, "regs_per_multiprocessor", 0) or 65536)
    per_clk = _FLOP_PER_CLK_SM.get(major, 2048)
    peak = sms * per_clk * 1.6e9 / 1e12
    fast = any(s in gpu.upper() for s in ("SXM", "NVL", "HGX", "GB", "B200", "B100"))
    gbps, lat = (150.0, 0.03) if fast else (20.0, 0.04)
    curves = {}
    for coll in COLLECTIVES:
        per = {}
        for w in (2, 4, 8):
            bw = gbps * (1.2 if coll == "copy_engine" else 1.0)
            per[str(w)] = [[s, round(lat + traffic_factor(coll, w) * s / (bw * 1e9) * 1e3, 6)] for s in sample_sizes()]
        curves[coll] = per
    return {
        "format": FORMAT,
        "name": name or f"roofline:{gpu}",
        "gpu": gpu,
        "source": "roofline from CUDA device properties (nothing measured); run `python -m overlap_compile profile`",
        "provisional": True,
        "roofline_only": True,
        "sm_count": sms,
        "smem_per_sm": smem,
        "regs_per_sm": regs,
        "max_blocks_per_sm": 32,
        "gemm": {
            "peak_tflops": {"bfloat16": round(peak, 1), "float16": round(peak, 1), "float32": round(peak / 16, 1)},
            "efficiency": {"bfloat16": 0.7, "float16": 0.7, "float32": 0.7},
            "mem_gbps": 1500.0,
            "floor_ms": 0.008,
            "table": [],
            "kernels": [
                {"name": "128x128", "block_m": 128, "block_n": 128, "block_k": 64, "stages": 3, "warps": 4,
                 "regs_per_thread": 168, "vs_cublas": 0.85},
            ],
        },
        "collectives": curves,
        "nccl_sms": {"all_reduce": 16, "reduce_scatter": 16, "all_gather": 16, "all_to_all": 16, "p2p": 8,
                     "copy_engine": 0},
        "launch_ms": {"eager": 0.015, "cuda_graph": 0.003},
        "contention": {"gemm_slowdown": 1.15, "gemm_slowdown_reserved": 1.05, "comm_slowdown": 1.1},
        "topology": {"gpus_per_node": 8, "peer_access": fast, "inter_node_gbps": 25.0, "inter_node_latency_ms": 0.03},
    }


def detect_profile_name() -> tuple[str, Any]:
    """What ``profile="auto"`` resolves to: ("builtin", name) or ("roofline", device properties).

    No CUDA: the built-in ``cpu-gloo`` (CUDA is not touched beyond ``is_available``). An H200 or
    H100 (by device name): its built-in. Any other GPU: a roofline from its properties.
    """
    import torch

    if not torch.cuda.is_available():
        return "builtin", "cpu-gloo"
    idx = torch.cuda.current_device()
    prof = builtin_for_device(torch.cuda.get_device_name(idx))
    if prof is not None:
        return "builtin", prof
    return "roofline", torch.cuda.get_device_properties(idx)


def builtin_for_device(device: str) -> str | None:
    """The built-in profile of a GPU by its device name ("NVIDIA H200" -> "h200"), None for others."""
    gpu = device.upper()
    for key, prof in (("H200", "h200"), ("H100", "h100")):
        if key in gpu:
            return prof
    return None
