# tile_fused's one-GPU race loops with each virtual rank's persistent grids on 1/W of the SMs, twice
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/vr; rm -rf $R; mkdir -p $R
for i in 1 2; do
  s=$(date +%s)
  timeout 250 python -m pytest -q -ra -p no:cacheprovider tests/gpu/test_tile_fused_virtual_ranks.py > $R/tf_$i.log 2>&1
  echo "round $i rc=$? $(( $(date +%s) - s ))s: $(grep -E 'passed|failed' $R/tf_$i.log | tail -1)"
  grep -E "^FAILED|^E  .*(Timeout|wrong)" $R/tf_$i.log | head -4 | cut -c1-240
done
tar -czf $OUT/results.tar.gz -C $R .
