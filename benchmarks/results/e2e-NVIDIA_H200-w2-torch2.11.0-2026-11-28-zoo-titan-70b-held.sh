# torchtitan 0.2.2's Llama 3 70B block (one layer, its own TP+SP plan) with the templates' buffers held until the join:
# async-TP left out to fit the call
# each mode in processes of its own, each variant in processes of its own (--isolate)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rt; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
python3 -m pip install -q --no-deps --no-index .wheelhouse/*.whl > $R/bench_install.log 2>&1 || tail -3 $R/bench_install.log
python3 -c 'import torchtitan, torchtitan.models.llama3; print("torchtitan", torchtitan.__version__ if hasattr(torchtitan, "__version__") else "?")' 2>&1 | tail -1
for mode in default reduce-overhead; do
  s=$(date +%s)
  timeout 285 python benchmarks/e2e.py --world 2 --models titan_llama3_70b --shapes 70b --modes $mode --isolate \
    --variants default,overlap,nocomm --phases train,prefill --train-calls 3 --iters 10 --check-cache off \
    --no-check-models --time-budget 0 --out $R/$mode > $R/e2e-$mode.log 2>&1
  echo "$mode rc=$? $(( $(date +%s) - s ))s"
  grep -E "^\|" $R/e2e-$mode.log | cut -d'|' -f2,4,5,6,7,8,9,10,11,12
  grep -iE "error|illegal|Traceback" $R/e2e-$mode.log | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
