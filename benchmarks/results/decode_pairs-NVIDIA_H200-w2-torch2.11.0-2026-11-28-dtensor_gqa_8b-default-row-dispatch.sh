# decode-sized calls in default mode of the DTensor GQA 8B block, with and without row_dispatch, and an A/A row;
# then the Megatron-style 8B dynamic prefill in default mode at the short lengths, with row_dispatch
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv | tail -1
s=$(date +%s)
timeout 200 torchrun --nproc-per-node 2 benchmarks/diagnostics/decode_pairs.py --model dtensor_gqa_8b --mode default \
  --seqs 16,64,128,256 --variants inductor-again,overlap,overlap-op-every-call --iters 20 --out $R > $R/decode.log 2>&1
echo "decode rc=$? $(( $(date +%s) - s ))s"; grep -E "^ +[0-9]+ " $R/decode.log; grep -iE "error|Traceback" $R/decode.log | head -5
s=$(date +%s)
timeout 280 python benchmarks/e2e.py --world 2 --models megatron_fused_8b --shapes 8b --modes default --variants default,overlap \
  --seqs 1024,2048,4096,16,256 --static-seqs 1024,2048,4096 --dynamic both --iters 20 \
  --time-budget 260 --check-cache off --no-check-models --out $R/e2e > $R/e2e.log 2>&1
echo "e2e rc=$? $(( $(date +%s) - s ))s"
grep -E "^\|" $R/e2e.log | tail -30 | cut -c1-200
grep -iE "error|illegal|Traceback" $R/e2e.log | head
