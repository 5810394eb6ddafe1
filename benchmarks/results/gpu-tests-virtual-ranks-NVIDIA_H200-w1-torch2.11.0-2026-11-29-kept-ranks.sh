# the one-GPU tests that run in processes of run_distributed's gloo harness (now forked from kept ranks):
# MoE and p2p_ring virtual ranks
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/vr; rm -rf $R; mkdir -p $R
for f in test_moe_virtual_ranks test_p2p_ring_virtual_ranks; do
  s=$(date +%s)
  timeout 260 python -m pytest -q -ra -p no:cacheprovider -s tests/gpu/$f.py > $R/$f.log 2>&1
  echo "$f rc=$? $(( $(date +%s) - s ))s: $(grep -E ' passed| failed' $R/$f.log | tail -1)"
  grep -E "^FAILED|^E  .*(Timeout|wrong|Error)" $R/$f.log | head -4 | cut -c1-240
done
tar -czf $OUT/results.tar.gz -C $R .
