# two GPUs: the Megatron-style and DTensor GQA blocks of size SIZE (8b, 70b, 8b-16k), each mode's variants compiled side by side in one
# process and timed one sample each per round (e2e.py --interleave), train step and prefill; torchtitan
# stays on its --isolate scripts (its framework compiles in place)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
SIZE=${SIZE:-8b}; M=${SIZE/-/_}  # the model suffix: 8b_16k for the shape 8b-16k
nvidia-smi --query-gpu=name --format=csv | tail -1
for m in ${MODES:-default reduce-overhead}; do  # MODES=one mode per call where both do not fit in one
  s=$(date +%s)
  timeout ${LIMIT:-280} python benchmarks/e2e.py --world 2 --models megatron_fused_$M,dtensor_gqa_$M --shapes $SIZE --modes $m \
    --variants default,overlap,async_tp,nocomm --phases train,prefill --train-calls 3 --iters 20 --interleave \
    --check-cache off --no-check-models --time-budget $(( ${LIMIT:-280} - 30 )) --out $R/$SIZE-$m > $R/$SIZE-$m.log 2>&1
  echo "$m rc=$? $(( $(date +%s) - s ))s"
  grep -E "^\|" $R/$SIZE-$m.log | cut -d'|' -f2,5,6,7,8,9,10,11
  grep -iE "error|illegal|Traceback" $R/$SIZE-$m.log | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
