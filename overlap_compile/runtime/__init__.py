"""What the template ops need at run time, shared by every template: process-group access
(``comm.py``), the cross-rank agreement on each rewritten site's plan (``agreement.py``),
symmetric-memory buffers (``symm.py``), bounded spin waits (``spin_wait.py``), the copy-engine
paths' peer readiness flags (``peer_flags.py``), buffers kept out of CUDA-graph pools
(``persistent.py``) and host-launched op calls replayed from per-site CUDA graphs
(``op_graphs.py``). Importing it touches neither CUDA nor a process group."""
