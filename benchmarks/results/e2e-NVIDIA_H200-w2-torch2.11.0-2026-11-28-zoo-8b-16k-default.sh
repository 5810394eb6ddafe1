# The long-context cells (seq 16384) in default mode, both forms, after op_graphs.apart
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r16d; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
timeout 270 python benchmarks/e2e.py --world 2 --models megatron_fused_8b_16k,dtensor_gqa_8b_16k --shapes 8b-16k --modes default \
  --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 10 --check-cache off --no-check-models --out $R > $R/e2e.log 2>&1
echo rc=$?; grep -E "^\| (megatron|dtensor)" $R/e2e.log | cut -d'|' -f2,5,6,7,9,10,11
for f in $R/e2e-*.json; do python -c "
import json;d=json.load(open('$f'))
for x in d: print(x['model'], x['variant'], 'peak', x.get('peak_mem_gib'), 'symm', x.get('symm_outside_gib'), 'loss ok', x.get('loss_matches_default'))"; done
tar -czf $OUT/results.tar.gz -C $R .
