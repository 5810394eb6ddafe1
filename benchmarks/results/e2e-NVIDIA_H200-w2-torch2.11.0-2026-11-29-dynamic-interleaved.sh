# two GPUs: dynamic prefill of both 8B forms with the four compiles (torch.compile and overlap, each
# dynamic and static) alive side by side and timed in the same rounds at every length
# (e2e.py --seqs ... --interleave); MODES: the compile modes, one per call if both do not fit
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
for m in ${MODES:-default}; do
  for model in megatron_fused_8b dtensor_gqa_8b; do
    s=$(date +%s)
    timeout ${LIMIT:-270} python benchmarks/e2e.py --world 2 --models $model --shapes 8b --modes $m --variants default,overlap \
      --seqs 1024,2048,3000,4096,8192,16384,16,256 --dynamic both --static-seqs 1024,2048,3000,4096,8192,16384 --iters 20 \
      --interleave --time-budget 0 --check-cache off --no-check-models --out $R/$model-$m > $R/$model-$m.log 2>&1
    echo "$model $m rc=$? $(( $(date +%s) - s ))s"
    grep -A11 "^dynamic prefill" $R/$model-$m.log | cut -c1-200
    grep -iE "error|illegal|Traceback" $R/$model-$m.log | head -5
  done
done
tar -czf $OUT/results.tar.gz -C $R .
