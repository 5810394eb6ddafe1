# dynamic prefill in default mode at the six lengths, one form per argument (megatron_fused_8b or dtensor_gqa_8b),
# with row_dispatch on; first the GPU test of the decode dispatch (megatron run only)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
MODEL=$1; BUDGET=${2:-400}
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
if [ "$MODEL" = megatron_fused_8b ]; then
  s=$(date +%s); timeout 150 python -m pytest -q -ra tests/gpu/test_dynamic_shapes_gpu.py -k host_launched_decode > $R/dispatch-test.log 2>&1
  echo "dispatch test rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/dispatch-test.log)"
fi
s=$(date +%s)
timeout $((BUDGET + 30)) python benchmarks/e2e.py --world 2 --models $MODEL --shapes 8b --modes default --variants default,overlap \
  --seqs 1024,2048,3000,4096,8192,16384 --static-seqs 1024,2048,3000,4096,8192,16384 --dynamic both --iters 20 \
  --time-budget $BUDGET --check-cache off --no-check-models --out $R > $R/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - s ))s"
grep -A14 "^dynamic prefill" $R/e2e.log | cut -c1-200
grep -iE "error|illegal|Traceback" $R/e2e.log | head
