"""Options of overlap_compile: one validated, frozen dataclass plus thread-local overrides.

    import overlap_compile as oc
    with oc.config.patch(min_speedup=1.05):      # context manager
        ...
    @oc.config.patch(force_template="p2p_ring")  # decorator
    def f(): ...
    oc.config.current()                          # the Options in effect on this thread

Every option has an environment override ``OVERLAP_COMPILE_<NAME>`` (read when no patch is active
on the thread); bad values raise ``ValueError`` naming the key and what is allowed. The pass
snapshots the Options when the forward compiles, so the backward runs under the same options.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
from typing import Any, Iterator

# Template names known to the library. Kept here (not imported from the registry) so that
# validating options never imports template code.
TEMPLATE_NAMES = ("signal_reorder", "p2p_ring", "priority_stream", "tile_fused", "moe_fused")
SEARCH_MODES = ("predict", "exhaustive", "measure")
ENV_PREFIX = "OVERLAP_COMPILE_"
# The longest bound on a GPU wait: the wait kernels take it as an int32 of microseconds
# (runtime/spin_wait.py, bound_us), ~35 minutes.
MAX_SIGNAL_TIMEOUT_MS = (2 ** 31 - 1) // 1000


@dataclasses.dataclass(frozen=True)
class Options:
    enabled: bool = True
    templates: tuple[str, ...] = TEMPLATE_NAMES
    force_template: str | None = None
    # with force_template: the configuration to use instead of the predicted best, as JSON text
    # (a dict is accepted and stored as its JSON); the template's plan() validates it
    force_config: str | None = None
    min_speedup: float = 1.03
    # and save at least this many microseconds per call: below it a gain is within what a site's
    # timing resolves and what a rewrite costs around it that its price leaves out (its stream
    # switch, the producer no longer writing the collective's buffer), e.g. decode-sized sites
    min_saved_us: float = 5.0
    profile: str = "auto"
    search: str = "predict"
    wave_group_first_max: int = 2
    wave_group_last_max: int = 4
    comm_priority: str | int = "highest"
    signal_timeout_ms: int = 10000
    dump_dir: str | None = None
    # host-launched graphs: let a site's op overhead hide behind the GPU work the host queued
    # before it (passes/host_pacing.py); False prices every op as if launched from idle
    host_pacing: bool = True
    # host-launched graphs: replay each op's stream work from a CUDA graph captured per (site,
    # buffers) instead of launching it piece by piece (runtime/op_graphs.py); read on a site's
    # first call
    op_graphs: bool = True
    # every collective left as written gets the compute that does not lead to it moved between
    # its start and its wait (passes/defer_compute.py: a backward's weight gradients beside its
    # data gradient's collective); not under force_template="baseline" (the graph as written).
    # Off: with it off the site it covered is rewritten instead, and a training step on GPUs ran as
    # fast, with Inductor's peak-memory reordering (which it turns off) keeping the step's peak
    # memory near torch.compile's (benchmarks/RESULTS.md)
    defer_compute: bool = False
    # each collective that defer_compute gave GEMMs to runs on the high-priority communication
    # stream (passes/prioritize.py), so that it gets SMs while those GEMMs run; off: on GPUs the
    # training steps measured the same with it as without (benchmarks/RESULTS.md)
    prioritize_deferred: bool = False
    # host-launched dynamic compiles: where every rewritten site of a graph is symbolic and runs
    # as written up to some M, calls at or below it run torch.compile's own compile of the graph,
    # made beside the rewritten one (row_dispatch.py): the bucketed ops' host time, not their GPU
    # time, is what a decode-sized call would lose
    whole_graph_as_written: bool = True
    # host-launched compiles with op_graphs on: a site run as written (a symbolic site's "as
    # written" bucket; in an inference graph, a site the decision kept) issues the GEMM and the
    # collective as priority_stream's one-chunk op, which runtime.op_graphs replays from a CUDA
    # graph: one launch in place of the GEMM's and c10d's host work (templates/bucketed.py,
    # passes/replay_kept.py); off: as Inductor (or the bucketed op's Python) launches them
    replay_written: bool = True
    # a site whose decision lies within the model's error (its predicted gain within the error
    # of min_speedup, or a rival template predicted within the error of the chosen one) is timed
    # once on its group (GPU groups only) and decided by the measured gain (passes/settle.py)
    measure_uncertain: bool = True
    # each MoE section's dispatch buffer (zeros + index_put with accumulate, on CUDA) is filled by
    # templates/moe_fused/scatter.py: a store per slot with one writer instead of ATen's atomic
    # add per element (passes/moe_scatter.py; exact); not under force_template="baseline"
    moe_scatter: bool = True

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def moves_compute(self) -> bool:
        """Whether the pass may move compute under collectives left as written (defer_compute;
        never when it is off or every site is forced to stay as written)."""
        return self.enabled and self.defer_compute and self.force_template != "baseline"

    @property
    def prioritizes_deferred(self) -> bool:
        """Whether collectives with compute moved under them run on the high-priority stream."""
        return self.moves_compute and self.prioritize_deferred

    @property
    def fills_moe_buffers(self) -> bool:
        """Whether MoE dispatch buffers are filled by moe_scatter_rows (passes/moe_scatter.py)."""
        return self.enabled and self.moe_scatter and self.force_template != "baseline"

    def to_json(self) -> str:
        """Stable text form: part of the compiler pass's cache key."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


_BOOLS = tuple(f.name for f in dataclasses.fields(Options) if f.type in (bool, "bool"))


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ValueError(f"overlap_compile option {key!r}: got {value!r}; allowed: {allowed}")


def _validate(o: Options) -> None:
    for key in _BOOLS:
        if not isinstance(getattr(o, key), bool):
            _fail(key, getattr(o, key), "True or False")
    if not isinstance(o.templates, tuple) or not all(t in TEMPLATE_NAMES for t in o.templates):
        _fail("templates", o.templates, f"a subset of {list(TEMPLATE_NAMES)}")
    if o.force_template is not None and o.force_template not in TEMPLATE_NAMES + ("baseline",):
        _fail("force_template", o.force_template, f"None, 'baseline' or one of {list(TEMPLATE_NAMES)}")
    if o.force_config is not None:
        try:
            cfg = json.loads(o.force_config) if isinstance(o.force_config, str) else None
        except ValueError:
            cfg = None
        if not isinstance(cfg, dict):
            _fail("force_config", o.force_config, "None or a JSON object (a dict) of the template's configuration")
        if o.force_template in (None, "baseline"):
            _fail("force_config", o.force_config, "a configuration only together with force_template=<a template>")
    if isinstance(o.min_speedup, bool) or not isinstance(o.min_speedup, (int, float)) or not o.min_speedup > 0:
        _fail("min_speedup", o.min_speedup, "a number > 0 (1.0 = rewrite whenever predicted faster)")
    if isinstance(o.min_saved_us, bool) or not isinstance(o.min_saved_us, (int, float)) or not o.min_saved_us >= 0:
        _fail("min_saved_us", o.min_saved_us, "a number of microseconds >= 0 (0 = any saving)")
    if not isinstance(o.profile, str) or not o.profile:
        _fail("profile", o.profile, "'auto', a built-in profile name, or a path to a profile JSON file")
    if o.search not in SEARCH_MODES:
        _fail("search", o.search, f"one of {list(SEARCH_MODES)}")
    for key in ("wave_group_first_max", "wave_group_last_max"):
        v = getattr(o, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _fail(key, v, "an integer >= 1")
    cp = o.comm_priority
    if not (cp == "highest" or (isinstance(cp, int) and not isinstance(cp, bool) and cp <= 0)):
        _fail("comm_priority", cp, "'highest' or an integer <= 0 (CUDA stream priority; lower is higher)")
    t = o.signal_timeout_ms
    if isinstance(t, bool) or not isinstance(t, int) or not 0 < t <= MAX_SIGNAL_TIMEOUT_MS:
        _fail("signal_timeout_ms", t, f"an integer number of milliseconds, 1 to {MAX_SIGNAL_TIMEOUT_MS}")
    if o.dump_dir is not None and not isinstance(o.dump_dir, str):
        _fail("dump_dir", o.dump_dir, "None or a directory path")


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}


def _coerce(key: str, value: Any) -> Any:
    """Turn user input (python values or env-var text) into the field's type, or fail clearly."""
    if key not in _FIELDS:
        raise ValueError(f"unknown overlap_compile option {key!r}; allowed: {sorted(_FIELDS)}")
    if key == "templates":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if value != "all" else TEMPLATE_NAMES
        if isinstance(value, (list, tuple, set, frozenset)):
            return tuple(sorted(value, key=lambda t: TEMPLATE_NAMES.index(t) if t in TEMPLATE_NAMES else 99))
        return value
    if key == "force_config" and isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    if not isinstance(value, str):
        return value
    text = value.strip()
    if key in _BOOLS:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return text
    if key in ("force_template", "force_config", "dump_dir") and text.lower() in ("", "none"):
        return None
    if key in ("min_speedup", "min_saved_us"):
        try:
            return float(text)
        except ValueError:
            return text
    if key in ("wave_group_first_max", "wave_group_last_max", "signal_timeout_ms", "comm_priority"):
        try:
            return int(text)
        except ValueError:
            return text
    return text


_ENV_NAMES = tuple(ENV_PREFIX + key.upper() for key in _FIELDS)
try:  # os.environ's keys as stored (bytes on POSIX); None: read through os.environ.get
    _ENCODED = tuple(os.environ.encodekey(name) for name in _ENV_NAMES)  # type: ignore[attr-defined]
except Exception:  # pragma: no cover - an interpreter without the private mapping
    _ENCODED = None


def _env_values() -> tuple:
    """The raw values of the OVERLAP_COMPILE_* variables (None where unset). Ops read the options
    on every call, host time a host-launched model pays per site (one ``os.environ.get`` per
    option and building Options cost tens of us), so this reads the environment's own mapping
    with pre-encoded keys where CPython has one, and Options are built once per distinct set of
    values (``_options_from``)."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict) and _ENCODED is not None:
        return tuple(data.get(k) for k in _ENCODED)
    return tuple(os.environ.get(name) for name in _ENV_NAMES)


def _from_env() -> Options:
    return _options_from(_env_values())


@functools.lru_cache(maxsize=32)
def _options_from(raw_values: tuple) -> Options:
    kwargs = {}
    for key, raw in zip(_FIELDS, raw_values):
        if raw is not None:
            kwargs[key] = _coerce(key, os.environ.decodevalue(raw) if isinstance(raw, bytes) else raw)
    try:
        return Options(**kwargs)
    except ValueError as e:
        raise ValueError(f"{e} (from environment variables {ENV_PREFIX}*)") from None


_local = threading.local()


def _stack() -> list[Options]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current() -> Options:
    """The options in effect on this thread: the innermost patch, else the environment."""
    stack = _stack()
    return stack[-1] if stack else _from_env()


class patch(contextlib.ContextDecorator):
    """Thread-local override of options; usable as ``with`` block and as a decorator."""

    def __init__(self, **overrides: Any) -> None:
        for key in overrides:
            if key not in _FIELDS:
                raise ValueError(f"unknown overlap_compile option {key!r}; allowed: {sorted(_FIELDS)}")
        self._overrides = {k: _coerce(k, v) for k, v in overrides.items()}
        # Validate now, so a bad value fails at the patch site, not at compile time.
        if self._overrides:
            dataclasses.replace(Options(), **self._overrides)

    def __enter__(self) -> Options:
        # nothing to override (a harness wrapping every call): no new Options to build and check
        opts = dataclasses.replace(current(), **self._overrides) if self._overrides else current()
        _stack().append(opts)
        return opts

    def __exit__(self, *exc: Any) -> None:
        _stack().pop()


@contextlib.contextmanager
def using(opts: Options) -> Iterator[Options]:
    """Make a whole Options object current (used to replay a snapshot)."""
    _stack().append(opts)
    try:
        yield opts
    finally:
        _stack().pop()


@functools.lru_cache(maxsize=None)
def option_names() -> tuple[str, ...]:
    return tuple(_FIELDS)
