"""A GEMM's latency as a profile holds it: the measured table (cuBLAS and the template kernels),
interpolated in efficiency between measured shapes, with a roofline fallback; and the template
GEMM kernel configurations, enough to know their occupancy."""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol


class SmLimits(Protocol):
    """What occupancy reads of a profile (a ``HardwareProfile`` has these)."""

    smem_per_sm: int
    regs_per_sm: int
    max_blocks_per_sm: int


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A template GEMM kernel configuration (Triton), enough to know its occupancy."""

    name: str
    block_m: int
    block_n: int
    block_k: int = 64
    stages: int = 3
    warps: int = 8
    regs_per_thread: int = 128
    vs_cublas: float = 0.9
    smem_bytes: int | None = None

    def smem(self, itemsize: int = 2) -> int:
        if self.smem_bytes is not None:
            return self.smem_bytes
        return self.stages * (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize

    def blocks_per_sm(self, profile: SmLimits, itemsize: int = 2) -> int:
        """Co-resident blocks per SM, limited by shared memory, registers and the hardware cap."""
        by_smem = profile.smem_per_sm // max(1, self.smem(itemsize))
        by_regs = profile.regs_per_sm // max(1, self.regs_per_thread * self.warps * 32)
        return max(1, min(by_smem, by_regs, profile.max_blocks_per_sm))


@dataclasses.dataclass(frozen=True)
class GemmModel:
    """GEMM latency: measured table, interpolated in efficiency, with a roofline fallback.

    For a shape in the table (same dtype and config) the measured time is returned. Otherwise the
    achieved efficiency (roofline time / measured time) of the nearest measured shapes (distance
    in log2(M, N, K)) is interpolated by inverse-distance weighting and applied to the shape's
    roofline time; far from every measured shape (more than 2 doublings away) it blends into the
    profile's default efficiency. A Triton kernel config without measurements is cuBLAS's time
    divided by the kernel's ``vs_cublas``.
    """

    peak_tflops: dict[str, float]
    efficiency: dict[str, float]
    mem_gbps: float
    floor_ms: float
    table: tuple[tuple[int, int, int, str, str | None, float], ...]
    kernels: tuple[Kernel, ...]
    # answers of ms() by (m, n, k, dtype, config): a decision prices the same GEMMs many times
    # (every candidate, bucket and M), and each answer scans and interpolates the whole table
    _memo: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def kernel(self, name: str | None) -> Kernel | None:
        for kern in self.kernels:
            if kern.name == name:
                return kern
        return None

    def kernel_for(self, block_m: int, block_n: int) -> Kernel | None:
        for kern in self.kernels:
            if (kern.block_m, kern.block_n) == (block_m, block_n):
                return kern
        return None

    def roofline_ms(self, m: int, n: int, k: int, dtype: str) -> float:
        peak = self.peak_tflops.get(dtype) or min(self.peak_tflops.values())
        flops_ms = 2.0 * m * n * k / (peak * 1e12) * 1e3
        item = 4 if dtype == "float32" else 2
        mem_ms = (m * k + k * n + m * n) * item / (self.mem_gbps * 1e9) * 1e3
        return max(flops_ms, mem_ms)

    def default_efficiency(self, dtype: str) -> float:
        return self.efficiency.get(dtype) or min(self.efficiency.values())

    def ms(self, m: int, n: int, k: int, dtype: str, config: str | None = None) -> float:
        key = (max(1, int(m)), max(1, int(n)), max(1, int(k)), dtype, config)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._ms(*key)
        return found

    def _ms(self, m: int, n: int, k: int, dtype: str, config: str | None) -> float:
        for tm, tn, tk, td, tc, t in self.table:
            if (tm, tn, tk, td, tc) == (m, n, k, dtype, config):
                return t
        if config is not None:
            kern = self.kernel(config)
            base = self.ms(m, n, k, dtype, None)
            measured = [e for e in self.table if e[3] == dtype and e[4] == config]
            if measured:  # measured Triton points: interpolate their efficiency directly
                return max(self.floor_ms, self.roofline_ms(m, n, k, dtype) / self._eff(m, n, k, dtype, measured))
            return base / (kern.vs_cublas if kern else 0.9)
        ref = [e for e in self.table if e[3] == dtype and e[4] is None]
        eff = self._eff(m, n, k, dtype, ref) if ref else self.default_efficiency(dtype)
        return max(self.floor_ms, self.roofline_ms(m, n, k, dtype) / eff)

    def _eff(self, m: int, n: int, k: int, dtype: str, entries: list) -> float:
        here = (math.log2(m), math.log2(n), math.log2(k))
        scored = []
        for tm, tn, tk, td, tc, t in entries:
            d = math.dist(here, (math.log2(tm), math.log2(tn), math.log2(tk)))
            eff = self.roofline_ms(tm, tn, tk, td) / t
            scored.append((d, eff))
        scored.sort()
        near = scored[:4]
        weights = [1.0 / (d + 0.05) ** 2 for d, _ in near]
        log_eff = sum(w * math.log(e) for w, (_, e) in zip(weights, near)) / sum(weights)
        d_min = near[0][0]
        if d_min > 2.0:
            lam = 2.0 / d_min
            log_eff = lam * log_eff + (1 - lam) * math.log(self.default_efficiency(dtype))
        return min(1.0, math.exp(log_eff))
