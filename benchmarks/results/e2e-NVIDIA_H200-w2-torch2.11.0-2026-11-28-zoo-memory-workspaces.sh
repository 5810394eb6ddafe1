# Peak memory with cuBLAS workspaces released before each configuration's base: the Megatron-style
# 8B and the DTensor 70B under reduce-overhead (the two cells past 5%), timed too
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rm; rm -rf $R; mkdir -p $R/8b $R/70b
nvidia-smi --query-gpu=name --format=csv | tail -1
timeout 200 python benchmarks/e2e.py --world 2 --models megatron_fused_8b --shapes 8b --modes reduce-overhead \
  --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 20 --check-cache off --no-check-models --out $R/8b > $R/8b/e2e.log 2>&1
echo rc=$?; grep -E "^\| megatron" $R/8b/e2e.log | cut -d'|' -f5,6,7,9,10,11
timeout 330 python benchmarks/e2e.py --world 2 --models dtensor_gqa_70b --shapes 70b --modes reduce-overhead \
  --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 10 --check-cache off --no-check-models --out $R/70b > $R/70b/e2e.log 2>&1
echo rc=$?; grep -E "^\| dtensor" $R/70b/e2e.log | cut -d'|' -f5,6,7,9,10,11
for f in $R/*/e2e-*.json; do python -c "
import json;d=json.load(open('$f'))
for x in d: print(x['model'], x['variant'], 'peak', x.get('peak_mem_gib'), 'base', x.get('mem_base_gib'), 'symm', x.get('symm_outside_gib'))"; done
tar -czf $OUT/results.tar.gz -C $R .
