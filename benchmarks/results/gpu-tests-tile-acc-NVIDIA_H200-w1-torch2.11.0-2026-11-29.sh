# one GPU: after the shared GEMM main loop (signal_reorder.tile_acc_jit) and the int32 wait bounds, the
# one-GPU tests of the files whose kernels changed, file by file, fresh Triton caches (-v, a bound per file)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
end=$(( $(date +%s) + ${BUDGET:-500} ))
for f in signal_reorder_gpu tile_fused_virtual_ranks kernel_loading tile_fused op_graphs teardown_gpu moe_scatter_gpu; do
  left=$(( end - $(date +%s) )); [ $left -lt 20 ] && { echo "$f: not run (time)"; continue; }
  t=$(( left < 200 ? left : 200 )); s=$(date +%s)
  export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
  timeout $t python -m pytest -v -ra tests/gpu/test_$f.py -m "gpu and not multigpu" -p no:cacheprovider > $R/$f.log 2>&1
  rc=$?; echo "$f rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$f.log | cut -c1-150)"
  grep -E "FAILED|ERROR |^E .*Error" $R/$f.log | cut -c1-240 | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
