# dynamic prefill in default mode, Megatron-style 8B, templates without record_stream (op graphs replay host-launched calls)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rdyn; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
timeout 400 python benchmarks/e2e.py --world 2 --models megatron_fused_8b --shapes 8b --modes default --variants default,overlap \
  --seqs 1024,2048,3000,4096,8192,16384,16,64,128,256 --static-seqs 1024,2048,3000,4096,8192,16384 --dynamic both --iters 20 \
  --time-budget 370 --check-cache off --no-check-models --out $R > $R/e2e.log 2>&1
echo rc=$?
grep -E "^\|" $R/e2e.log | tail -40 | cut -c1-220
grep -iE "error|illegal|Traceback" $R/e2e.log | head
tar -czf $OUT/results.tar.gz -C $R .
