# two GPUs (carry .wheelhouse): what the DTensor-plan 70B training steps hold at their own peak (in
# whichever calls it comes: memory_account --at-peak's peak_in), torch.compile against overlap, both
# modes; the cells of #35's memory rule that miss (torchtitan 70B, DTensor GQA 70B under reduce-overhead)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
python3 -m pip install -q --no-deps --no-index .wheelhouse/*.whl > $R/bench_install.log 2>&1 || tail -3 $R/bench_install.log
for model in titan_llama3_70b dtensor_gqa_70b; do
  for mode in reduce-overhead default; do
    s=$(date +%s)
    timeout 130 python benchmarks/diagnostics/memory_account.py --world 2 --models $model --modes $mode --phases train \
      --variants inductor,overlap --at-peak --out $R/$model-$mode > $R/$model-$mode.log 2>&1
    echo "$model $mode rc=$? $(( $(date +%s) - s ))s"
    grep -hE "^\| (titan|dtensor)|MiB allocated" $R/$model-$mode/memory_account*.md | head -6 | cut -c1-220
  done
done
tar -czf $OUT/results.tar.gz -C $R .
