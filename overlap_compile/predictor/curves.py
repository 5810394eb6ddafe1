"""A collective's latency as a profile holds it: one ``Curve`` per collective and world size,
sampled at ascending message sizes, and the ring traffic factor that carries a curve over to a
world size the profile did not sample (the byte convention: predictor/profile.py)."""
from __future__ import annotations

import bisect
import dataclasses
import math


# Share of the message that each rank's links carry, per collective, as a function of the world
# size (ring algorithms): used to carry a curve over to a world size the profile did not sample.
def traffic_factor(collective: str, world: int) -> float:
    w = max(world, 2)
    if collective == "all_reduce":
        return 2.0 * (w - 1) / w
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (w - 1) / w
    return 1.0


@dataclasses.dataclass(frozen=True)
class Curve:
    """Latency of one collective at one world size, sampled at ascending byte sizes.

    Interpolation is linear in log(bytes)-log(ms). Below the smallest sample the time is the
    smallest sample's (the latency floor); above the largest it grows linearly with the bytes
    at the last sample's bandwidth. Times are made non-decreasing in size on load (a larger
    message never takes less time; measured noise is flattened by a running maximum).
    """

    sizes: tuple[int, ...]
    ms: tuple[float, ...]

    @staticmethod
    def from_points(points: list[tuple[int, float]]) -> "Curve":
        sizes, times, run = [], [], 0.0
        for b, t in points:
            run = max(run, float(t))
            sizes.append(int(b))
            times.append(run)
        return Curve(tuple(sizes), tuple(times))

    def __call__(self, nbytes: float) -> float:
        s, t = self.sizes, self.ms
        if nbytes <= s[0]:
            return t[0]
        if nbytes >= s[-1]:
            return t[-1] * nbytes / s[-1]
        i = bisect.bisect_left(s, nbytes)
        if s[i] == nbytes:
            return t[i]
        x0, x1, y0, y1 = math.log(s[i - 1]), math.log(s[i]), math.log(t[i - 1]), math.log(t[i])
        return math.exp(y0 + (y1 - y0) * (math.log(nbytes) - x0) / (x1 - x0))

    def scaled(self, factor: float) -> "Curve":
        return Curve(self.sizes, tuple(v * factor for v in self.ms))

    def to_json(self) -> list[list[float]]:
        return [[b, round(t, 6)] for b, t in zip(self.sizes, self.ms)]
