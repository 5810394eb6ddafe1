#!/usr/bin/env bash
# One device call on a multi-GPU machine: GPU tests, the hardware profile, the operator
# benchmark. Each step has its own time limit so one slow step cannot eat the others; logs and
# JSON go to $OUT (at most 8 files come back: keep it that way).
#   usage: bash benchmarks/run_multigpu.sh [ops_kinds] [ops_limit] [steps: tests,ops,profile]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=$(python3 -c 'import torch; print(torch.cuda.device_count())')
KINDS=${1:-gemm_allreduce,gemm_reducescatter,gemm_alltoall}
LIMIT=${2:-0}
STEPS=${3:-tests,ops,profile}
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())' | tee -a "$OUT/env.txt"

if [[ $STEPS == *tests* ]]; then
echo "== GPU tests (world $W)"
timeout 150 python3 -m pytest -q -x -ra tests/gpu 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"

fi
if [[ $STEPS == *profile* ]]; then
echo "== profile (world $W)"
timeout 300 torchrun --standalone --nproc-per-node "$W" -m overlap_compile profile --out "$OUT/profile-w$W.json" 2>&1 | tail -15 | tee "$OUT/profile_log.txt"

fi
if [[ $STEPS == *ops* ]]; then
echo "== ops benchmark (world $W)"
timeout 400 python3 benchmarks/ops.py --world "$W" --kinds "$KINDS" --limit "$LIMIT" --out "$OUT" 2>&1 | grep -v Warning | tail -80 | tee "$OUT/ops_log.txt"
fi
