# one GPU: p2p_ring's virtual-rank race loops with 32 hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS;
# the default is 8): does the one-GPU intermittent timeout come from streams sharing a queue?
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export CUDA_DEVICE_MAX_CONNECTIONS=32
R=/tmp/R; rm -rf $R; mkdir -p $R
for round in 1 2; do
  s=$(date +%s); timeout 145 python -m pytest -v -ra tests/gpu/test_p2p_ring_virtual_ranks.py -p no:cacheprovider > $R/round$round.log 2>&1
  echo "round $round rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/round$round.log | cut -c1-150)"
  grep -E "PASSED|FAILED|ERROR " $R/round$round.log | cut -c1-200 | head -10
  grep -E "^E .*(Timeout|wait|timed)" $R/round$round.log | cut -c1-300 | head -3
done
tar -czf $OUT/results.tar.gz -C $R .
