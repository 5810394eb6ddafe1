# two GPUs: the Megatron-style and DTensor GQA 8b blocks, each mode's variants compiled side by side in one
# process and timed one sample each per round (e2e.py --interleave), train step and prefill; torchtitan
# stays on its --isolate scripts (its framework compiles in place)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
for m in ${MODES:-default reduce-overhead}; do  # MODES=one mode per call where both do not fit in one
  s=$(date +%s)
  timeout ${LIMIT:-280} python benchmarks/e2e.py --world 2 --models megatron_fused_8b,dtensor_gqa_8b --shapes 8b --modes $m \
    --variants default,overlap,async_tp,nocomm --phases train,prefill --train-calls 3 --iters 20 --interleave \
    --check-cache off --no-check-models --time-budget $(( ${LIMIT:-280} - 30 )) --out $R/$m > $R/$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s ))s"
  grep -E "^\|" $R/$m.log | cut -d'|' -f2,5,6,7,8,9,10,11
  grep -iE "error|illegal|Traceback" $R/$m.log | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
