#!/usr/bin/env bash
# One device call on a multi-GPU machine, steps chosen by name, each with its own time limit so
# one slow step cannot eat the others. Everything lands in $OUT/results.tar.gz (one file: the
# device tool brings back at most 8), plus a short log on stdout.
#   usage: STEPS=profile,predictor,tests,ops,host,moe,sweep,e2e bash benchmarks/run_multigpu.sh
#   with torchtitan (e2e's titan_llama3_*): first, on a machine with a registry,
#     pip download --no-deps --only-binary :all: --python-version 3.12 -d .wheelhouse <pyproject's [bench] list>
#   and carry .wheelhouse along
#   knobs: TESTS, TESTS_FLAGS (default -x), OPS_KINDS (or all), OPS_TEMPLATES (methods: templates, auto, async_tp),
#          OPS_LIMIT, OPS_ARGS (e.g. --time-budget 200), PRED_LIMIT, E2E_ARGS, E2E_DEFER_ARGS / E2E_NOSETTLE_ARGS (the
#          overlap variant again with defer_compute on / measure_uncertain off), MOE_ARGS (e.g. --time-budget 300
#          --routing uniform,skewed --modes default,reduce-overhead --experts-sweep 8,16,32,64), HOST_ARGS, SWEEP_ARGS,
#          <STEP>_TIMEOUT (see each step)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; R=$OUT/r; mkdir -p "$R"
W=$(python3 -c 'import torch; print(torch.cuda.device_count())')
STEPS=${STEPS:-tests,ops}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() { echo "== $1 ($(date +%T))"; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/env.txt" | head -2
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version())' | tee -a "$R/env.txt"
PROFILE=${PROFILE:-auto}
# the benchmarks' own dependencies (pyproject's [bench]: torchtitan and what its Llama 3 imports) from a
# wheelhouse carried along: these machines reach no package registry
if [ -d .wheelhouse ] && ls .wheelhouse/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .wheelhouse/*.whl > "$R/bench_install.log" 2>&1 || tail -3 "$R/bench_install.log"
  python3 -c 'import torchtitan.models.llama3' 2>&1 | tail -1 | sed 's/^/torchtitan: /'
fi

if has profile; then
  step "profile (world $W)"
  timeout 90 torchrun --standalone --nproc-per-node "$W" -m overlap_compile profile --out "$R/profile-w$W.json" --name h200 > "$R/profile.log" 2>&1
  tr '\r' '\n' < "$R/profile.log" | grep -E "wrote|Error|error" | grep -v Warn | tail -5
  if [ -f "$R/profile-w$W.json" ]; then
    # contention fitted to the measured template runs (the command's cuBLAS-beside-all_reduce
    # figure is recorded in the notes)
    timeout 120 python3 benchmarks/fitting/calibrate_contention.py benchmarks/results/predictor-NVIDIA_H200-w4-torch2.11.0-2026-11-22-measuredprofile.json \
      --profile "$R/profile-w$W.json" --write "$R/h200.json" 2>&1 | grep -E "best|wrote|Error" | tail -3
    [ -f "$R/h200.json" ] && PROFILE=$R/h200.json
  fi
fi
if has predictor; then
  step "predictor (world $W, profile $PROFILE)"
  timeout ${PRED_TIMEOUT:-150} python3 benchmarks/predictor.py --world "$W" --profile "$PROFILE" --kinds ${PRED_KINDS:-gemm_allreduce,gemm_reducescatter,gemm_alltoall} \
    --limit ${PRED_LIMIT:-3} --max-candidates 3 --iters 10 --time-budget ${PRED_BUDGET:-100} --out "$R" > "$R/predictor.log" 2>&1
  grep -E "mean \|error|predicted-best|decision|kept the baseline|lost to" "$R/predictor.log" | head -8
fi
if has tests; then
  step "GPU tests (world $W)"
  timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q ${TESTS_FLAGS:--x} -ra ${TESTS:-tests/gpu} > "$R/gpu_tests.log" 2>&1
  tail -8 "$R/gpu_tests.log"
fi
if has ops; then
  step "ops (world $W)"
  timeout ${OPS_TIMEOUT:-150} python3 benchmarks/ops.py --world "$W" --kinds "${OPS_KINDS:-gemm_reducescatter,allgather_gemm}" \
    --limit "${OPS_LIMIT:-0}" ${OPS_TEMPLATES:+--templates $OPS_TEMPLATES} ${OPS_ARGS:-} --out "$R" > "$R/ops.log" 2>&1
  grep -v Warn "$R/ops.log" | tail -30
fi
if has host; then
  step "host time per op call (world $W)"
  timeout ${HOST_TIMEOUT:-150} python3 benchmarks/host_profile.py --world "$W" ${HOST_ARGS:-} --out "$R" > "$R/host.log" 2>&1
  grep -E "us/call|wrote" "$R/host.log" | tail -20
fi
if has moe; then
  # moe.py's own --time-budget (default 300 s on GPUs) plus its 120 s grace ends inside MOE_TIMEOUT and
  # still writes its rows (JSON, .md, PNGs); killed by the timeout, moe-partial-*.jsonl has them
  step "moe (world $W)"
  timeout ${MOE_TIMEOUT:-480} python3 benchmarks/moe.py --world "$W" --out "$R" ${MOE_ARGS:-} > "$R/moe.log" 2>&1
  grep -v Warn "$R/moe.log" | grep -vE "^wrote .*png$" | tail -60 | cut -c1-170
fi
if has sweep; then
  step "occupancy sweep (world $W)"
  timeout ${SWEEP_TIMEOUT:-200} python3 benchmarks/diagnostics/occupancy_sweep.py --world "$W" --out "$R" ${SWEEP_ARGS:-} > "$R/sweep.log" 2>&1
  grep -v Warn "$R/sweep.log" | tail -30
fi
if has e2e; then
  step "e2e (world $W)"
  timeout ${E2E_TIMEOUT:-200} python3 benchmarks/e2e.py --world "$W" --out "$R" ${E2E_ARGS:-} > "$R/e2e.log" 2>&1
  grep -v Warn "$R/e2e.log" | tail -25
  # the overlap variant again with one option set against its default, to see its share: rows
  # *-defer.json (defer_compute on) / *-nosettle.json (measure_uncertain off)
  for switch in DEFER:DEFER_COMPUTE:1 NOSETTLE:MEASURE_UNCERTAIN:0; do
    tag=${switch%%:*}; rest=${switch#*:}; option=${rest%%:*}; value=${rest#*:}
    args_var=E2E_${tag}_ARGS; timeout_var=E2E_${tag}_TIMEOUT
    if [ -n "${!args_var:-}" ]; then
      step "e2e with $option=$value (world $W)"
      env OVERLAP_COMPILE_$option=$value timeout ${!timeout_var:-200} python3 benchmarks/e2e.py --world "$W" --out "$R" \
        ${!args_var} > "$R/e2e-${tag,,}.log" 2>&1
      grep -v Warn "$R/e2e-${tag,,}.log" | tail -12
    fi
  done
fi
step "pack"
tar -czf "$OUT/results.tar.gz" -C "$R" . && rm -rf "$R"
ls -la "$OUT"
