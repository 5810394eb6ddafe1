# Megatron-style 70B under reduce-overhead (59% hidden before), then the op-graph GPU tests
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/r70; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
timeout 330 python benchmarks/e2e.py --world 2 --models megatron_fused_70b --shapes 70b --modes reduce-overhead \
  --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 10 --check-cache off --no-check-models --out $R > $R/e2e.log 2>&1
echo rc=$?; grep -E "^\| megatron" $R/e2e.log | cut -d'|' -f5,6,7,9,10,11
timeout 150 python -m pytest -q -m gpu tests/gpu/test_op_graphs.py > $R/gpu-tests.log 2>&1; echo tests rc=$?; tail -3 $R/gpu-tests.log
tar -czf $OUT/results.tar.gz -C $R .
