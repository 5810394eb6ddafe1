# the GPU dynamic-shape tests with "as written" buckets replayed (default mode) and row_dispatch on;
# then the DTensor GQA 8B block's dynamic prefill again at the two longest lengths
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rt; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
s=$(date +%s); timeout 360 python -m pytest -q -ra tests/gpu/test_dynamic_shapes_gpu.py tests/test_bucketed_replayed_written.py > $R/tests.log 2>&1
echo "tests rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/tests.log)"; grep -E "FAILED|ERROR|SKIPPED" $R/tests.log | head
s=$(date +%s)
timeout 150 python benchmarks/e2e.py --world 2 --models dtensor_gqa_8b --shapes 8b --modes default --variants default,overlap \
  --seqs 8192,16384 --static-seqs 8192,16384 --dynamic both --iters 20 --time-budget 140 --check-cache off --no-check-models \
  --out $R/e2e > $R/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - s ))s"; grep -A4 "^dynamic prefill" $R/e2e.log | cut -c1-200
tar -czf $OUT/results.tar.gz -C $R .
