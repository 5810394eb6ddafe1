# one GPU: p2p_ring's first virtual-rank race (RS under op graphs) with cold Triton and Inductor caches,
# twice, then once warm: does a cold cache reproduce the one-GPU ring-step-0 timeout?
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
T="tests/gpu/test_p2p_ring_virtual_ranks.py::test_every_call_right_with_two_virtual_ranks[True-gemm_reducescatter]"
for round in cold1 cold2 warm; do
  [ $round != warm ] && export TRITON_CACHE_DIR=/tmp/triton-$round TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$round
  s=$(date +%s); timeout 100 python -m pytest -v -ra "$T" -p no:cacheprovider > $R/$round.log 2>&1
  echo "$round rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/$round.log | cut -c1-120)"
  grep -E "^E .*PeerWait|CUDA Graph is empty|could not be captured" $R/$round.log | cut -c1-220 | head -3
done
tar -czf $OUT/results.tar.gz -C $R .
