# the GPU tests a time limit cut after the templates dropped record_stream, then where DTensor 70B's extra memory sits
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
t() { name=$1; shift; s=$(date +%s); timeout "$@" > $R/$name.log 2>&1; rc=$?; echo "$name rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$name.log)"; }
t op_graphs 150 python -m pytest -q -ra tests/gpu/test_op_graphs.py
t signal_reorder 130 python -m pytest -q -ra tests/gpu/test_signal_reorder_gpu.py
t memory 270 python benchmarks/diagnostics/memory_account.py --world 2 --models dtensor_gqa_70b --modes default --phases train --variants inductor,overlap --at-peak --out $R
grep -E "^\| dtensor" $R/memory_account*.md | head -8
