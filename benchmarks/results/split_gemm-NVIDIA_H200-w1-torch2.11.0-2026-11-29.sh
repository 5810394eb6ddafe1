# one GPU: what cutting a GEMM into row pieces costs (diagnostics/split_gemm.py), then every one-GPU GPU test
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tail -1
python -c "import torch,triton;print(torch.__version__, triton.__version__)"
s=$(date +%s); timeout 200 python benchmarks/diagnostics/split_gemm.py --out $R > $R/split_gemm.log 2>&1
echo "split_gemm rc=$? $(( $(date +%s) - s ))s"; tail -48 $R/split_gemm.log
s=$(date +%s); timeout 330 python -m pytest -q -ra tests/gpu -m "gpu and not multigpu" -p no:cacheprovider --durations=15 > $R/gpu-tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - s ))s"; tail -40 $R/gpu-tests.log
tar -czf $OUT/results.tar.gz -C $R .
