# one GPU: e2e --interleave's mechanics on a GPU (W=1: no site to rewrite, so overlap runs as
# torch.compile does): several compiled variants alive and timed side by side, host-launched and under
# CUDA-graph trees (reduce-overhead), beside the same variants timed one at a time
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
for m in default reduce-overhead; do
  s=$(date +%s)
  timeout 240 python benchmarks/e2e.py --world 1 --models megatron_fused_8b --modes $m --variants default,overlap,nocomm \
    --iters 10 --interleave --no-check-models --check-cache off --time-budget 0 --out $R/interleave-$m > $R/interleave-$m.log 2>&1
  echo "interleave $m rc=$? $(( $(date +%s) - s ))s"; grep -E "^ *megatron|ERROR|Error" $R/interleave-$m.log | cut -c1-260 | head -8
  s=$(date +%s)
  timeout 200 python benchmarks/e2e.py --world 1 --models megatron_fused_8b --modes $m --variants default,overlap,nocomm \
    --iters 10 --no-check-models --check-cache off --time-budget 0 --out $R/alone-$m > $R/alone-$m.log 2>&1
  echo "alone $m rc=$? $(( $(date +%s) - s ))s"; grep -E "^ *megatron|ERROR|Error" $R/alone-$m.log | cut -c1-260 | head -8
done
tar -czf $OUT/results.tar.gz -C $R .
