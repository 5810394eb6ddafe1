# host time per p2p_ring call, old tree vs new tree, interleaved, then GPU tests
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
R=$OUT; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then D=abold/host_before; else D=.; fi
    echo "== $tree round $round"
    (cd $D && PYTHONPATH=$PWD timeout 150 python benchmarks/host_profile.py --world 2 --kinds gemm_reducescatter,allgather_gemm \
      --templates p2p_ring --shapes 8b --op-graphs off --calls 300 --out $R/host_$tree$round 2>&1 | grep -E "us/call|Error|error" | grep -v Warn)
  done
done
echo "== GPU tests"
timeout 170 python -m pytest -q -x -ra tests/gpu/test_p2p_ring.py tests/gpu/test_op_graphs.py > $R/gpu_tests_p2p.log 2>&1; tail -3 $R/gpu_tests_p2p.log
timeout 100 python -m pytest -q -x -ra tests/gpu/test_p2p_ring_virtual_ranks.py > $R/gpu_tests_vr.log 2>&1; tail -3 $R/gpu_tests_vr.log
timeout 120 python -m pytest -q -ra tests/gpu/test_tile_fused.py -k "against and (reducescatter or allreduce or allgather)" > $R/gpu_tests_tf.log 2>&1; tail -3 $R/gpu_tests_tf.log
