"""Host-launched dynamic compiles: calls whose row counts every rewritten site runs as written go
to torch.compile's own compile of the graph.

A symbolic site's bucketed op (templates/bucketed.py) runs a decode-sized M as written when its
table says so, but still pays its dispatch and Python on every call, and a host-bound call
(decode: ~0.2 ms of GPU work behind >1 ms of launches) loses that to torch.compile. Where the
pass found every rewritten site of the forward graph symbolic and "as written" up to some M
(passes/as_written_rows.py), the backend also compiles the graph as torch.compile does and
returns a function that picks per call::

    compiled(*args) -> plain(*args)    if every site's M (bound from args' sizes) <= its limit
                       overlap(*args)  otherwise

The pick binds each size symbol to the input it came from (a SymInt argument, else a tensor's
dim) and is cached per tuple of those sizes: an int compare per call once a length was seen.
Under CUDA graphs (reduce-overhead) a replay costs no host time, so no second compile is made.
The backward of a call is the one its forward's compile made, so a decode-sized training step
runs torch.compile's backward too.
"""
from __future__ import annotations

from typing import Any, Callable

import sympy
import torch

_SEEN_MAX = 4096  # lengths remembered per graph (a serving process sees a bounded set)


def symbol_sources(example_inputs: list[Any]) -> dict[Any, tuple[int, int | None]]:
    """Per size symbol of the inputs, where a call carries its value: (input index, None) for a
    SymInt input, (input index, dim) for a tensor's size; SymInt inputs first (cheapest to read)."""
    out: dict[Any, tuple[int, int | None]] = {}
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt) and isinstance(x.node.expr, sympy.Symbol):
            out.setdefault(x.node.expr, (i, None))
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor):
            for d, s in enumerate(x.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    out.setdefault(s.node.expr, (i, d))
    return out


class RowDispatch:
    """``pick(args)``: True where every (expression, limit) of ``limits`` holds at the call's sizes.
    ``calls``: {"plain": n, "overlap": n} so far (tests, diagnostics)."""

    def __init__(self, limits: list[tuple[Any, int]], sources: dict[Any, tuple[int, int | None]]) -> None:
        symbols = sorted({s for e, _ in limits for s in e.free_symbols}, key=str)
        missing = [s for s in symbols if s not in sources]
        if missing:
            raise ValueError(f"row_dispatch: no input carries the size symbols {missing}")
        self.symbols = symbols
        self.where = [sources[s] for s in symbols]
        self.limits = limits
        self.calls = {"plain": 0, "overlap": 0}
        self._seen: dict[tuple, bool] = {}

    def pick(self, args: Any) -> bool:
        key = tuple(args[i] if d is None else args[i].shape[d] for i, d in self.where)
        got = self._seen.get(key)
        if got is None:
            env = {s: sympy.Integer(int(v)) for s, v in zip(self.symbols, key)}
            got = all(int(e.xreplace(env)) <= limit for e, limit in self.limits)
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen[key] = got
        self.calls["plain" if got else "overlap"] += 1
        return got


def dispatching(overlap: Callable, plain: Callable, dispatch: RowDispatch) -> Callable:
    """One callable that runs ``plain`` where ``dispatch`` picks it, else ``overlap``, called as
    Dynamo calls a backend's result: positionally (Inductor's result accepts that although it
    marks itself boxed; the wrapper does not, so nothing hands it a list)."""
    def run(*args: Any) -> Any:
        return (plain if dispatch.pick(args) else overlap)(*args)

    run.row_dispatch = dispatch  # type: ignore[attr-defined]
    return run
