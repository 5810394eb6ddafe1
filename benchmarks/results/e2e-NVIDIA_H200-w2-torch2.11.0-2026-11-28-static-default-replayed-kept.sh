# host-launched inference compiles replaying the sites kept as written (passes/replay_kept.py): the GPU test,
# then prefill at 1024 and 2048 tokens in default mode, static and dynamic, both 8B forms
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rk; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
s=$(date +%s); timeout 80 python -m pytest -q -ra tests/gpu/test_replay_kept_gpu.py > $R/test.log 2>&1
echo "test rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/test.log)"; grep -E "^E |FAILED" $R/test.log | head -5
for model in megatron_fused_8b dtensor_gqa_8b; do
  s=$(date +%s)
  timeout 95 python benchmarks/e2e.py --world 2 --models $model --shapes 8b --modes default --variants default,overlap \
    --seqs 1024,2048 --static-seqs 1024,2048 --dynamic both --iters 20 --time-budget 85 --check-cache off --no-check-models \
    --out $R/e2e-$model > $R/e2e-$model.log 2>&1
  echo "e2e $model rc=$? $(( $(date +%s) - s ))s"; grep -A3 "^dynamic prefill" $R/e2e-$model.log | cut -c1-200
  grep -iE "error|illegal|Traceback" $R/e2e-$model.log | head -3
done
tar -czf $OUT/results.tar.gz -C $R .
