# dynamic prefill in default mode, both 8B forms, with "as written" buckets run as a replayed op
# (replay_written_buckets on); then decode_pairs: overlap with it on and off beside torch.compile's
# dynamic compile in alternating rounds, with the A/A row, at prefill and decode lengths
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rw; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
for model in megatron_fused_8b dtensor_gqa_8b; do
  s=$(date +%s)
  timeout 200 python benchmarks/e2e.py --world 2 --models $model --shapes 8b --modes default --variants default,overlap \
    --seqs 1024,2048,3000,4096,8192,16384 --static-seqs 1024,2048,3000,4096,8192,16384 --dynamic both --iters 20 \
    --time-budget 185 --check-cache off --no-check-models --out $R/e2e-$model > $R/e2e-$model.log 2>&1
  echo "e2e $model rc=$? $(( $(date +%s) - s ))s"
  grep -A9 "^dynamic prefill" $R/e2e-$model.log | cut -c1-200
  grep -iE "error|illegal|Traceback" $R/e2e-$model.log | head -5
done
for model in megatron_fused_8b dtensor_gqa_8b; do
  s=$(date +%s)
  timeout 110 torchrun --nproc-per-node 2 benchmarks/diagnostics/decode_pairs.py --model $model --mode default \
    --seqs 1024,2048,16,256 --variants inductor-again,overlap,overlap-written-direct --iters 20 --out $R/pairs-$model > $R/pairs-$model.log 2>&1
  echo "decode_pairs $model rc=$? $(( $(date +%s) - s ))s"; grep -E "^ +[0-9]+ |variant" $R/pairs-$model.log | head -20
  grep -iE "error|Traceback" $R/pairs-$model.log | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
