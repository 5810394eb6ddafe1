#!/usr/bin/env bash
# One device call on a one-GPU machine, steps chosen by name, each with its own time limit.
# Everything lands in $OUT/results.tar.gz (the device tool brings back a limited number of
# files: a run that wrote many lost some on 2026-11-23), plus a short log on stdout.
#   usage: STEPS=signal,experts,tests,reorder bash benchmarks/run_one_gpu.sh
#   steps:  signal   gemm.py --signal-at group_end,next_tile,none on the AR/RS/A2A shapes
#           experts  moe_experts.py (the persistent expert kernel vs bmm), EXPERTS_ARGS
#           tests    GPU tests that need one GPU (TESTS, default: expert kernel + signal layout)
#           reorder  diagnostics/reorder_consumer.py (the un-reorder in an RMSNorm consumer), REORDER_ARGS
#           profile  fitting/profile_measures.py: the signal and experts results into PROFILE_BASE (h200)
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R"
STEPS=${STEPS:-signal,experts,tests}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() { echo "== $1 ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/env.txt" | head -2
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$R/env.txt"

if has signal; then
  step "signalling points"
  timeout ${SIGNAL_TIMEOUT:-300} python3 benchmarks/gemm.py --out "$R" --sets gemm_allreduce,gemm_reducescatter,gemm_alltoall \
    --repeat 3 --signal-at group_end,next_tile,none > "$R/signal.log" 2>&1
  grep -v Warn "$R/signal.log" | tail -24
fi
if has experts; then
  step "expert kernel vs bmm"
  timeout ${EXPERTS_TIMEOUT:-240} python3 benchmarks/moe_experts.py --out "$R" ${EXPERTS_ARGS:---world 2 --limit 4} > "$R/experts.log" 2>&1
  grep -v Warn "$R/experts.log" | tail -12
fi
if has tests; then
  step "one-GPU tests"
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -ra ${TESTS:-tests/gpu/test_moe_expert_kernel_gpu.py tests/gpu/test_signal_reorder_gpu.py} \
    > "$R/gpu_tests.log" 2>&1
  tail -8 "$R/gpu_tests.log"
fi
if has reorder; then
  step "reorder consumer"
  timeout ${REORDER_TIMEOUT:-200} python3 benchmarks/diagnostics/reorder_consumer.py --out "$R" ${REORDER_ARGS:-} > "$R/reorder.log" 2>&1
  grep -v Warn "$R/reorder.log" | tail -12
fi
if has profile; then
  step "profile update"
  GEMM_JSON=$(ls "$R"/gemm-*-w1-*.json 2>/dev/null | head -1)
  EXPERTS_JSON=$(ls "$R"/moe_experts-*.json 2>/dev/null | head -1)
  timeout 120 python3 benchmarks/fitting/profile_measures.py --profile "${PROFILE_BASE:-h200}" \
    ${GEMM_JSON:+--gemm "$GEMM_JSON"} ${EXPERTS_JSON:+--experts "$EXPERTS_JSON"} --out "$R/profile-measured.json" 2>&1 | tail -3
fi
step "pack"
tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
ls -la "$OUT"
