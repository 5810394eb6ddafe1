# p2p_ring's reduce-scatter with its own stripe computed into the output (GPU test), then decode-sized calls in default mode:
# the overlap compile with calls at M every rewritten site runs as written sent to torch.compile's own compile
# (row_dispatch), beside the same compile without it (the ops at every M) and an A/A row
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
s=$(date +%s); timeout 150 python -m pytest -q -ra tests/gpu/test_p2p_ring.py > $R/p2p_ring.log 2>&1; echo "p2p_ring rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/p2p_ring.log)"
s=$(date +%s)
timeout 330 torchrun --nproc-per-node 2 benchmarks/diagnostics/decode_pairs.py --model megatron_fused_8b --mode default \
  --seqs 16,64,128,256,1024 --variants inductor-again,overlap,overlap-op-every-call --iters 20 --out $R > $R/decode.log 2>&1
echo "decode rc=$? $(( $(date +%s) - s ))s"; grep -E "^ +[0-9]+ " $R/decode.log; grep -iE "error|Traceback" $R/decode.log | head -5
