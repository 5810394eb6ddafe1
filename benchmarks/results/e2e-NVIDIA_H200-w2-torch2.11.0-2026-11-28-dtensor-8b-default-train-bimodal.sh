# DTensor GQA 8B default-mode training step: the same plan measured 0.92-1.04x across runs. Three
# settings, two rounds each: as is, without tile_fused, without op graphs
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/rb; rm -rf $R; mkdir -p $R
run() { name=$1; shift; mkdir -p $R/$name
  env "$@" timeout 170 python benchmarks/e2e.py --world 2 --models dtensor_gqa_8b --shapes 8b --modes default \
    --variants default,overlap --phases train --train-calls 3 --iters 20 --repeat 2 --no-check-models --check-cache off --out $R/$name > $R/$name/e2e.log 2>&1
  echo "== $name rc=$?"; grep -E "^\| dtensor" $R/$name/e2e.log | cut -d'|' -f5,6,7
  grep -h "train_ms_rounds\|op replays" $R/$name/e2e.log | head -4; }
run asis X=1
run no_tile_fused OVERLAP_COMPILE_TEMPLATES=signal_reorder,p2p_ring,priority_stream
run no_op_graphs OVERLAP_COMPILE_OP_GRAPHS=0
tar -czf $OUT/results.tar.gz -C $R .
