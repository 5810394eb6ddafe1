"""overlap_compile: torch.compile passes that hide communication behind computation.

    import overlap_compile as oc
    torch.compile(model, backend="overlap")
    with oc.enable(): torch.compile(model)(x)
    with oc.config.patch(min_speedup=1.05): ...
    print(oc.explain(model, x, backward=True))
    print(oc.plan(meta_model, meta_x, backward=True))  # no GPU: what the pass would do

Importing this package registers the ``torch.ops.overlap_compile.*`` ops; it initialises
neither CUDA nor any process group.
"""
from __future__ import annotations

from . import config
from .backend import overlap_backend
from .config import Options
from .explain import explain
from .plan import plan
from .inductor_hook import OverlapPass, enable
from .report import GraphRecord, Report, SiteReport, global_report as last_report
from . import templates as _templates

_templates.load_all_ops()

__all__ = [
    "config", "Options", "enable", "explain", "plan", "overlap_backend", "OverlapPass",
    "Report", "SiteReport", "GraphRecord", "last_report",
]
__version__ = "0.1.0"
