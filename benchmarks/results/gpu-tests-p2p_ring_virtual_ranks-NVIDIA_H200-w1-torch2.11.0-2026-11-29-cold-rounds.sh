# one GPU: p2p_ring's first virtual-rank race with fresh Triton and Inductor caches each round, run with
# load_kernels repeating its throwaway round until one completed (a test change tried and reverted)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
T="tests/gpu/test_p2p_ring_virtual_ranks.py::test_every_call_right_with_two_virtual_ranks[True-gemm_reducescatter]"
for round in ${ROUNDS:-cold1 cold2}; do
  d=$(mktemp -d); export TRITON_CACHE_DIR=$d/triton TORCHINDUCTOR_CACHE_DIR=$d/inductor  # fresh each round, even on a warm machine
  s=$(date +%s); timeout 100 python -m pytest -v -ra "$T" -p no:cacheprovider > $R/$round.log 2>&1
  echo "$round rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/$round.log | cut -c1-120)"
  grep -E "^E .*PeerWait" $R/$round.log | cut -c1-200 | head -2
done
[ -n "${SKIP_FILE:-}" ] || { s=$(date +%s); timeout 120 python -m pytest -v -ra tests/gpu/test_p2p_ring_virtual_ranks.py -p no:cacheprovider > $R/warm-file.log 2>&1
echo "file rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/warm-file.log | cut -c1-120)"; }
tar -czf $OUT/results.tar.gz -C $R .
