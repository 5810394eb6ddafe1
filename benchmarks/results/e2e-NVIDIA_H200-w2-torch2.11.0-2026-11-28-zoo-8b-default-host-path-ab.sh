# 8B zoo default mode with the new host path, then the Megatron-style block with the code before (A/B)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT; mkdir -p $R/new $R/old
nvidia-smi --query-gpu=name --format=csv | tail -1
echo "== new"
PYTHONPATH=$PWD timeout 330 python benchmarks/e2e.py --world 2 --models megatron_fused_8b,dtensor_gqa_8b --shapes 8b --modes default \
  --variants default,overlap,async_tp,nocomm --phases train,prefill --train-calls 3 --iters 20 --no-check-models --out $R/new > $R/new/e2e.log 2>&1
grep -E "^\|" $R/new/e2e.log | cut -d'|' -f2,5,6,7,8,9,10,11 
echo "== old (megatron_fused_8b default / overlap)"
(cd abold/host_before && PYTHONPATH=$PWD timeout 200 python benchmarks/e2e.py --world 2 --models megatron_fused_8b --shapes 8b --modes default \
  --variants default,overlap --phases train,prefill --train-calls 3 --iters 20 --no-check-models --out $R/old > $R/old/e2e.log 2>&1)
grep -E "^\|" $R/old/e2e.log | cut -d'|' -f2,5,6,7,8,9,10,11
