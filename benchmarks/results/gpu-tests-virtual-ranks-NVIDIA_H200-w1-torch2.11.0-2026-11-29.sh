# the one-GPU tests: the virtual-rank race loops (tile_fused, p2p_ring, MoE), op graphs, kernel loading
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/vr; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tail -1
for f in test_tile_fused_virtual_ranks test_p2p_ring_virtual_ranks test_op_graphs test_kernel_loading; do
  s=$(date +%s)
  timeout 200 python -m pytest -q -ra -p no:cacheprovider --durations=5 tests/gpu/$f.py > $R/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s) - s ))s: $(grep -E 'passed|failed' $R/$f.log | tail -1)"
  grep -E "^FAILED|^E  .*(Timeout|wrong|Error)" $R/$f.log | head -4 | cut -c1-240
done
tar -czf $OUT/results.tar.gz -C $R .
