set -u
R=$OUT/r; mkdir -p $R
timeout 200 python -m pytest -q -ra tests/gpu/test_p2p_ring_virtual_ranks.py > $R/vr_p2p.log 2>&1; tail -2 $R/vr_p2p.log
timeout 150 python -m pytest -q -ra tests/gpu/test_tile_fused_virtual_ranks.py -k "m2 or m5" > $R/vr_tf.log 2>&1; tail -2 $R/vr_tf.log
tar -czf $OUT/results.tar.gz -C $R . && rm -rf $R
