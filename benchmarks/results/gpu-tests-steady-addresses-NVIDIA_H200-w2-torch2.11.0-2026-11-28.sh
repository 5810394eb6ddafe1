# no record_stream in the templates (held until the join): the steady-address test on this tree and on the tree before (abold/), then the templates' GPU tests
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
t() { name=$1; shift; s=$(date +%s); timeout "$@" > $R/$name.log 2>&1; rc=$?; echo "$name rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$name.log)"; }
t steady-after 100 env PYTHONPATH=$PWD python -m pytest -q -s -ra tests/gpu/test_steady_addresses_gpu.py
(cd abold && t steady-before 100 env PYTHONPATH=$PWD python -m pytest -q -s -ra tests/gpu/test_steady_addresses_gpu.py)
grep -h "stats" $R/steady-after.log $R/steady-before.log | cut -c1-600
export PYTHONPATH=$PWD
t p2p_ring 150 python -m pytest -q -ra tests/gpu/test_p2p_ring.py
t tile_fused 100 python -m pytest -q -ra tests/gpu/test_tile_fused.py -k "against and (reducescatter or allreduce or allgather)"
t priority 120 python -m pytest -q -ra tests/gpu/test_priority_stream_gpu.py tests/gpu/test_prioritize_gpu.py tests/gpu/test_op_graphs.py
t signal_moe 80 python -m pytest -q -ra tests/gpu/test_signal_reorder_gpu.py tests/gpu/test_moe_gpu.py
