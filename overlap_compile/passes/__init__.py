"""The overlap pass: a post-grad FX graph -> its GEMM/collective sites -> a decision per site ->
the rewritten graph, priced by the predictor and emitted by the templates (which read only the
site dataclasses of ``matches.py``; the predictor imports nothing from here).

* ``find.py``: graph -> matches, pure (``find_moe.py``, ``find_moe_backward.py``: MoE sections)
* ``matches.py``: one dataclass per site kind, its FX nodes named by role
* ``decide.py``: all sites at once -> one ``Decision`` per site, with its reason
* ``decision.py``: ``Decision`` and the gain a rewrite must clear
* ``host_pacing.py``: host-launched graphs: sites whose op host time hides behind queued GPU work
* ``rewrite.py``: applies decisions to the graph (``rewrite_moe_backward.py``: a backward MoE section)
* ``pipeline.py``: find, decide, rewrite in order, and the record for the Report
* ``graph_utils.py``: small helpers for reading and writing the graphs
"""
