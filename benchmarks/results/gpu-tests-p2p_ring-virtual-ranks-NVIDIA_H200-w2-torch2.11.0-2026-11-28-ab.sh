# the one-GPU race loop of p2p_ring's reduce-scatter under op graphs, code before vs after, interleaved
set -u
R=$OUT/r; mkdir -p $R
T="tests/gpu/test_p2p_ring_virtual_ranks.py::test_every_call_right_with_two_virtual_ranks[True-gemm_reducescatter]"
for i in 1 2; do
  for tree in after before; do
    if [ $tree = before ]; then D=abold/host_before; else D=.; fi
    (cd $D && PYTHONPATH=$PWD timeout 75 python -m pytest -q -x "$T" > $R/vr_${tree}_$i.log 2>&1; echo "$tree $i: $(tail -1 $R/vr_${tree}_$i.log)")
  done
done
tar -czf $OUT/results.tar.gz -C $R . && rm -rf $R
