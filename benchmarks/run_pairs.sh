#!/usr/bin/env bash
# Two 2-GPU jobs side by side on a 4-GPU machine (GPUs 0,1 and 2,3), each under its own time limit,
# their logs and outputs packed into $OUT/results.tar.gz. Each job measures its baseline itself, in
# its own run, so the pairs' numbers are ratios within one job (the pairs share the host's CPUs).
#   usage: PAIR_A="python benchmarks/soak.py --minutes 6 --world 2 --out \$R" \
#          PAIR_B="python benchmarks/e2e.py --world 2 ... --out \$R" LIMIT=560 bash benchmarks/run_pairs.sh
# $R (the jobs' output folder) is exported to both; a job left empty is not run.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; export R=$OUT/r; mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/env.txt" | head -2
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())' | tee -a "$R/env.txt"
if [ -d .wheelhouse ] && ls .wheelhouse/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index .wheelhouse/*.whl > "$R/bench_install.log" 2>&1 || tail -3 "$R/bench_install.log"
fi
run() {  # name, GPUs, command
  [ -n "$3" ] || return 0
  echo "== $1 on GPUs $2 ($(date +%T)): $3"
  CUDA_VISIBLE_DEVICES=$2 MASTER_PORT=$((29500 + ${2:0:1})) timeout ${LIMIT:-560} bash -c "$3" > "$R/$1.log" 2>&1
  echo "== $1 exit $? ($(date +%T))"
}
run pair_a 0,1 "${PAIR_A:-}" &
run pair_b 2,3 "${PAIR_B:-}" &
wait
for j in pair_a pair_b; do [ -f "$R/$j.log" ] && { echo "--- $j (tail)"; grep -v -i warn "$R/$j.log" | tail -${TAIL:-25}; }; done
tar czf "$OUT/results.tar.gz" -C "$OUT" r
