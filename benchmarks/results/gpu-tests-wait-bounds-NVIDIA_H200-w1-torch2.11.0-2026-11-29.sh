# one GPU: the bounded waits take their bound as an int32 of microseconds (one compiled variant for
# every bound). p2p_ring's first virtual-rank race (RS under op graphs) with fresh Triton and Inductor
# caches, twice (it failed 2 of 2 before); then, each file with fresh caches, the virtual-rank race
# files and the one-GPU tests of the kernels whose wait bound changed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
end=$(( $(date +%s) + ${BUDGET:-570} ))
cold() { export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); }
T="tests/gpu/test_p2p_ring_virtual_ranks.py::test_every_call_right_with_two_virtual_ranks[True-gemm_reducescatter]"
for round in first-cold1 first-cold2; do
  cold; s=$(date +%s); timeout 100 python -m pytest -v -ra "$T" -p no:cacheprovider > $R/$round.log 2>&1
  echo "$round rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/$round.log | cut -c1-120)"
  grep -E "^E .*PeerWait|CUDA Graph is empty|could not be captured" $R/$round.log | cut -c1-220 | head -3
done
for f in p2p_ring_virtual_ranks tile_fused_virtual_ranks moe_expert_kernel_gpu signal_reorder_gpu moe_virtual_ranks; do
  left=$(( end - $(date +%s) )); [ $left -lt 20 ] && { echo "$f: not run (time)"; continue; }
  t=$(( left < 200 ? left : 200 )); s=$(date +%s); cold
  timeout $t python -m pytest -v -ra tests/gpu/test_$f.py -m "gpu and not multigpu" -p no:cacheprovider > $R/$f.log 2>&1
  rc=$?; echo "$f rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$f.log | cut -c1-150)"
  grep -E "FAILED|ERROR " $R/$f.log | cut -c1-240 | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
