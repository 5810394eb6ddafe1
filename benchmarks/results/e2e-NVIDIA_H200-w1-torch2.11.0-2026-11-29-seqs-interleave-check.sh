# one GPU: e2e --seqs --interleave's mechanics on a GPU (W=1: no site to rewrite): torch.compile and
# overlap, each compiled dynamic and static, alive together at every length, host-launched and under
# CUDA-graph trees; both input forms (Megatron-style local shards, DTensor GQA's DTensor)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
for m in default reduce-overhead; do
  s=$(date +%s)
  timeout 270 python benchmarks/e2e.py --world 1 --models megatron_fused_8b,dtensor_gqa_8b --modes $m --seqs 1024,16,4096 \
    --iters 10 --interleave --no-check-models --time-budget 0 --out $R/seqs-$m > $R/seqs-$m.log 2>&1
  echo "seqs interleave $m rc=$? $(( $(date +%s) - s ))s"
  grep -E "^ *(megatron|dtensor)|ERROR|Error|rule|paired|      [0-9]" $R/seqs-$m.log | cut -c1-230 | head -30
done
tar -czf $OUT/results.tar.gz -C $R .
