"""The overlap pass: a post-grad FX graph -> its GEMM/collective sites -> a decision per site ->
the rewritten graph. It asks the predictor for prices and the template registry for what each
template supports and emits. The predictor imports nothing from here; the templates read only
the site dataclasses (``matches.py``).

* ``find.py``: graph -> matches, pure (``find_moe.py``: the expert-parallel MoE sections,
  ``find_moe_backward.py``: their backward, ``moe_probes.py``: the probes both run)
* ``matches.py``: one dataclass per site kind, its FX nodes named by role
* ``decide.py``: all sites at once -> one ``Decision`` per site, with its reason
* ``decision.py``: ``Decision`` and the gain a rewrite must clear (shared by decide.py and
  host_pacing.py)
* ``host_pacing.py``: host-launched graphs: the sites whose op host time hides behind queued GPU
  work
* ``rewrite.py``: applies decisions to the graph (``rewrite_moe_backward.py``: a backward MoE section)
* ``pipeline.py``: find, decide, rewrite in order, and the record for the Report
* ``graph_utils.py``: small helpers for reading and writing the graphs
"""
