"""Hardware profiles loaded by this process, kept per file version (path, mtime, size) or per
roofline GPU: a profile file is parsed once, an edited one is read again."""
from __future__ import annotations

import threading
from typing import Any, Callable

from .profile import HardwareProfile

_lock = threading.Lock()
_profiles: dict[Any, HardwareProfile] = {}


def get_or_make(key: Any, make: Callable[[], HardwareProfile]) -> HardwareProfile:
    """The profile cached under ``key``, else ``make()`` cached there (``key`` None: not cached)."""
    if key is not None:
        with _lock:
            if key in _profiles:
                return _profiles[key]
    prof = make()
    if key is None:
        return prof
    with _lock:
        return _profiles.setdefault(key, prof)


def named(name: str) -> HardwareProfile | None:
    """The last loaded profile whose ``name`` is ``name``, if any."""
    with _lock:
        hits = [p for p in _profiles.values() if p.name == name]
    return hits[-1] if hits else None


def clear() -> None:
    with _lock:
        _profiles.clear()
