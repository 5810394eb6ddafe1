# one GPU: (1) which of the compiler modules the test harness's kept ranks pre-imported makes a forked
# child unable to use CUDA on a CUDA build (a fresh interpreter per module: import it, fork, ask the
# child); (2) with those imports now skipped on CUDA builds, the wait-bounds runs again: p2p_ring's first
# virtual-rank race with fresh caches twice, then the three virtual-rank race files, fresh caches each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=/tmp/R; rm -rf $R; mkdir -p $R
end=$(( $(date +%s) + ${BUDGET:-560} ))
cold() { export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d); }
for m in overlap_compile torch._functorch.aot_autograd torch._inductor.codegen.cpp torch._inductor.compile_fx \
         torch._inductor.fx_passes.post_grad torch._inductor.scheduler; do
  python - "$m" <<'PY' 2>&1 | tee -a $R/fork-poison.log
import importlib, os, sys, traceback
import torch
calls = []
def prof(frame, event, arg):
    if event == "c_call" and getattr(arg, "__name__", "") == "_cuda_getDeviceCount":
        calls.append("".join(traceback.format_stack(frame, limit=5)))
sys.setprofile(prof)
importlib.import_module(sys.argv[1])
sys.setprofile(None)
pid = os.fork()
if pid == 0:
    os._exit(3 if torch._C._cuda_isInBadFork() else 0)
_, st = os.waitpid(pid, 0)
print(f"{sys.argv[1]}: child in bad fork: {os.waitstatus_to_exitcode(st) == 3}; _cuda_getDeviceCount calls: {len(calls)}")
if calls:
    print(calls[0][-1200:])
PY
done
T="tests/gpu/test_p2p_ring_virtual_ranks.py::test_every_call_right_with_two_virtual_ranks[True-gemm_reducescatter]"
for round in first-cold1 first-cold2; do
  cold; s=$(date +%s); timeout 100 python -m pytest -v -ra "$T" -p no:cacheprovider > $R/$round.log 2>&1
  echo "$round rc=$? $(( $(date +%s) - s ))s: $(tail -1 $R/$round.log | cut -c1-120)"
  grep -E "^E .*(PeerWait|RuntimeError)|CUDA Graph is empty|could not be captured" $R/$round.log | cut -c1-220 | head -3
done
for f in p2p_ring_virtual_ranks moe_virtual_ranks tile_fused_virtual_ranks; do
  left=$(( end - $(date +%s) )); [ $left -lt 20 ] && { echo "$f: not run (time)"; continue; }
  t=$(( left < 240 ? left : 240 )); s=$(date +%s); cold
  timeout $t python -m pytest -v -ra tests/gpu/test_$f.py -m "gpu and not multigpu" -p no:cacheprovider > $R/$f.log 2>&1
  rc=$?; echo "$f rc=$rc $(( $(date +%s) - s ))s: $(tail -1 $R/$f.log | cut -c1-150)"
  grep -E "FAILED|ERROR |^E .*Error" $R/$f.log | cut -c1-240 | head -5
done
tar -czf $OUT/results.tar.gz -C $R .
