# the GPU tests the first call's time limit cut, templates without record_stream: prioritized collective (its input held until its join), priority_stream, moe_fused
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT; mkdir -p $R
t() { name=$1; shift; s=$(date +%s); timeout "$@" > $R/$name.log 2>&1; rc=$?; echo "$name rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$name.log)"; }
t prioritize 110 python -m pytest -q -ra tests/gpu/test_prioritize_gpu.py
t priority_stream 100 python -m pytest -q -ra tests/gpu/test_priority_stream_gpu.py
t moe 110 python -m pytest -q -ra tests/gpu/test_moe_gpu.py
