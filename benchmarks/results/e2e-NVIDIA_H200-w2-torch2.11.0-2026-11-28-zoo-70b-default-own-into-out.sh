# peak memory of the DTensor-plan 70B blocks in default mode with p2p_ring's reduce-scatter computing its own stripe
# into the op's output (no temporary stripe beside it): dtensor_gqa_70b, then torchtitan's 70B (isolated)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r70m; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
python3 -m pip install -q --no-deps --no-index .wheelhouse/*.whl > $R/bench_install.log 2>&1 || tail -3 $R/bench_install.log
s=$(date +%s)
timeout 170 python benchmarks/e2e.py --world 2 --models dtensor_gqa_70b --shapes 70b --modes default \
  --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 10 --check-cache off --no-check-models --out $R/dtensor > $R/e2e-dtensor.log 2>&1
echo "dtensor rc=$? $(( $(date +%s) - s ))s"; grep -E "^\|" $R/e2e-dtensor.log | cut -d'|' -f2,5,6,7,8,9,10,11
s=$(date +%s)
timeout 200 python benchmarks/e2e.py --world 2 --models titan_llama3_70b --shapes 70b --modes default --isolate \
  --variants default,overlap --phases train,prefill --train-calls 3 --iters 10 --check-cache off --no-check-models --time-budget 0 --out $R/titan > $R/e2e-titan.log 2>&1
echo "titan rc=$? $(( $(date +%s) - s ))s"; grep -E "^\|" $R/e2e-titan.log | cut -d'|' -f2,5,6,7,8,9,10,11
python - <<'P'
import json, glob
for f in sorted(glob.glob('/tmp/r70m/*/e2e-*.json')):
    for r in json.load(open(f)):
        print(r['model'], r['method'], 'peak', round(r.get('peak_mem_gib') or 0, 3), 'symm', round(r.get('symm_outside_gib') or 0, 3))
P
tar -czf $OUT/results.tar.gz -C $R .
