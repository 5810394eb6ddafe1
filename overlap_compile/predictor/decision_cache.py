"""The decision cache: the predictor's answers per site, keyed on everything an answer depends on
(site signature, profile content, launch mode, group topology, search options), so recompiles
repeat no search and every rank of a group answers alike. Entries are copied in and out: a caller
that mutates its answer never changes the cache."""
from __future__ import annotations

import copy
import threading
from typing import Any

MISSING = object()

_lock = threading.Lock()
_entries: dict[tuple, Any] = {}


def key(what: str, match: Any, site: Any, profile: Any, opts: Any, ctx: Any) -> tuple:
    """The cache key of answer ``what`` (e.g. "baseline", "rank:<template>") for one site."""
    return (what, match.signature(), profile.key, ctx, site.cross_node, opts.search, opts.op_graphs)


def get(key: tuple) -> Any:
    """A copy of the cached answer, or ``MISSING``."""
    with _lock:
        value = _entries.get(key, MISSING)
    return value if value is MISSING else copy.deepcopy(value)


def put(key: tuple, value: Any) -> None:
    with _lock:
        _entries[key] = copy.deepcopy(value)


def keys() -> list[tuple]:
    with _lock:
        return list(_entries)


def clear() -> None:
    with _lock:
        _entries.clear()
