# one GPU: every one-GPU test of tests/gpu not run on this day's earlier call, file by file (-v, a bound per file)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
end=$(( $(date +%s) + ${BUDGET:-540} ))
for f in dynamic_shapes_gpu memory_accounting_gpu moe moe_backward moe_expert_kernel_gpu moe_gpu moe_op_graphs moe_packed_gpu \
         moe_routed moe_scatter_gpu p2p_ring prioritize_gpu priority_stream_gpu reduce_overhead replay_kept_gpu settle_gpu \
         signal_reorder_gpu steady_addresses_gpu teardown_gpu tile_fused; do
  left=$(( end - $(date +%s) )); [ $left -lt 20 ] && { echo "$f: not run (time)"; continue; }
  t=$(( left < 150 ? left : 150 )); s=$(date +%s)
  timeout $t python -m pytest -v -ra tests/gpu/test_$f.py -m "gpu and not multigpu" -p no:cacheprovider > $R/$f.log 2>&1
  rc=$?; echo "$f rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$f.log | cut -c1-150)"
  grep -E "FAILED|ERROR " $R/$f.log | cut -c1-240 | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
