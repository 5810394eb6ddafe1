# 70B reduce-overhead, templates without record_stream (buffers held until the join); async-TP left out to fit the call
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r70ro; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
timeout 470 python benchmarks/e2e.py --world 2 --models megatron_fused_70b,dtensor_gqa_70b --shapes 70b --modes reduce-overhead \
  --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 10 --check-cache off --no-check-models --out $R > $R/e2e.log 2>&1
echo rc=$?
grep -E "^\|" $R/e2e.log | cut -d'|' -f2,5,6,7,8,9,10,11
grep -iE "error|illegal|Traceback" $R/e2e.log | head
tar -czf $OUT/results.tar.gz -C $R .
