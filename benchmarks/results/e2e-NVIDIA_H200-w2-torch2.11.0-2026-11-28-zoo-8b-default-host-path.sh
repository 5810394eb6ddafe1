# the 8B zoo cells in default mode (two rounds over the variants), then the p2p_ring virtual-rank race loops; one tarball back
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
PYTHONPATH=$PWD timeout 360 python benchmarks/e2e.py --world 2 --models megatron_fused_8b,dtensor_gqa_8b --shapes 8b --modes default \
  --variants default,overlap,async_tp,nocomm --phases train,prefill --train-calls 3 --iters 20 --repeat 2 --no-check-models --out $R > $R/e2e.log 2>&1
grep -E "^\|" $R/e2e.log | cut -d'|' -f2,5,6,7,8,9,10,11,16
timeout 170 python -m pytest -q -x -ra tests/gpu/test_p2p_ring_virtual_ranks.py > $R/gpu_tests_vr.log 2>&1; tail -3 $R/gpu_tests_vr.log
tar -czf $OUT/results.tar.gz -C $R . && rm -rf $R
