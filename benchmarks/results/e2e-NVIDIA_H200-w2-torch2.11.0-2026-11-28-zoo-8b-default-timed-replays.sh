# settle's timing with untimed per-round calls until replay: the GPU test (timed alike before and after a model's steps), then the 8B default-mode zoo, two rounds
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/ra; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
timeout 200 python -m pytest -q -s tests/gpu/test_settle_gpu.py -k "stays_exact or timed_alike" > $R/gpu-test.log 2>&1
echo test rc=$?
grep -E "passed|failed|ms|Error" $R/gpu-test.log | tail -15
timeout 360 python benchmarks/e2e.py --world 2 --models megatron_fused_8b,dtensor_gqa_8b --shapes 8b --modes default \
  --variants default,overlap,async_tp,nocomm --phases train,prefill --train-calls 3 --iters 20 --repeat 2 --check-cache off --no-check-models --out $R > $R/e2e.log 2>&1
echo rc=$?
grep -E "^\|" $R/e2e.log | cut -d'|' -f2,5,6,7,8,9,10,11
grep -iE "error|illegal|Traceback" $R/e2e.log | head
tar -czf $OUT/results.tar.gz -C $R .
