# decode-sized calls in default mode, paired with torch.compile's dynamic compile, templates without record_stream
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT/r; mkdir -p $R
timeout 160 torchrun --nproc-per-node 2 benchmarks/diagnostics/decode_pairs.py --model megatron_fused_8b --mode default \
  --seqs 16,64,128,256 --variants inductor-again,overlap --out $R > $R/decode.log 2>&1
echo rc=$?; grep -E "^ +[0-9]+ " $R/decode.log
