# DTensor GQA 8B dynamic prefill in default mode at the six lengths (row_dispatch on), then where torchtitan 70B's
# training step holds its memory at its peak, torch.compile against overlap, default and reduce-overhead
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R/dyn $R/mem
nvidia-smi --query-gpu=name --format=csv | tail -1
python3 -m pip install -q --no-deps --no-index .wheelhouse/*.whl > $R/bench_install.log 2>&1 || tail -3 $R/bench_install.log
s=$(date +%s)
timeout 330 python benchmarks/e2e.py --world 2 --models dtensor_gqa_8b --shapes 8b --modes default --variants default,overlap \
  --seqs 1024,2048,3000,4096,8192,16384 --static-seqs 1024,2048,3000,4096,8192,16384 --dynamic both --iters 20 \
  --time-budget 300 --check-cache off --no-check-models --out $R/dyn > $R/dyn/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - s ))s"
grep -A10 "^dynamic prefill" $R/dyn/e2e.log | cut -c1-200
grep -iE "error|illegal|Traceback" $R/dyn/e2e.log | head
for mode in default reduce-overhead; do
  s=$(date +%s)
  timeout 120 python benchmarks/diagnostics/memory_account.py --world 2 --models titan_llama3_70b --modes $mode --phases train \
    --variants inductor,overlap --at-peak --out $R/mem/$mode > $R/mem/$mode.log 2>&1
  echo "memory $mode rc=$? $(( $(date +%s) - s ))s"
  grep -hE "^\| titan" $R/mem/$mode/memory_account*.md | head -4 | cut -d'|' -f2-12
done
