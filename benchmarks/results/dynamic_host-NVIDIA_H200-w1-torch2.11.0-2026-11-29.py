"""One GPU, W=1: the DTensor GQA 8B block's dynamic compile under torch.compile and under the
overlap backend (no site at W=1): their generated code side by side, their host time per call,
and their times in alternating rounds (A/B, and an A/A: torch.compile against itself), at 1024 and
2048 tokens. Writes code and a JSON summary under $OUT."""
import json, os, sys, difflib, statistics
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29541")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
from torch._inductor.utils import run_and_get_code
import overlap_compile as oc
from benchmarks.models import build
from benchmarks.e2e import load_shapes
from benchmarks.e2e_run import compiled
from benchmarks.e2e_dynamic import sequence_dim, input_at
from benchmarks.timing import time_interleaved, host_ms_per_call

out = os.environ.get("OUT", "/tmp")
model_name = sys.argv[1] if len(sys.argv) > 1 else "dtensor_gqa_8b"
shape = next(s for s in load_shapes("8b", False))
fns, codes = {}, {}
for v in ("default", "default_again", "overlap"):
    built = build(model_name, {**shape, "seq": 2048}, "cuda", torch.bfloat16, seed=0)
    # default_again: a second torch.compile, a backend of its own (options), the same Inductor config
    fn, _ = compiled(built.model, "overlap" if v == "overlap" else "default", "default", None, oc.Report(), None,
                     {"shape_padding": True} if v == "default_again" else None, dynamic=None)
    dim = sequence_dim(built.x, model_name)
    x = input_at(built.x, dim, 1024)
    torch._dynamo.mark_dynamic(x, dim)
    with torch.no_grad():
        _, code = run_and_get_code(fn, x)
    codes[v] = "\n\n#####\n\n".join(code)
    with open(os.path.join(out, f"code-{v}.py"), "w") as f:
        f.write(codes[v])
    fns[v] = fn
norm = lambda c: [l for l in c.splitlines() if l.strip() and not l.lstrip().startswith("#")]
summary = {"model": model_name, "code_lines": {v: len(norm(c)) for v, c in codes.items()},
           "code_diff_lines_vs_default": {v: sum(1 for l in difflib.unified_diff(norm(codes["default"]), norm(c), lineterm="")
                                                  if l[:1] in "+-" and l[:3] not in ("+++", "---"))
                                          for v, c in codes.items() if v != "default"}}
print(json.dumps(summary))
for seq in (1024, 2048):
    x = input_at(built.x, dim, seq)
    with torch.no_grad():
        calls = {v: (lambda fn=fn: fn(x)) for v, fn in fns.items()}
        got = time_interleaved(calls, iters=40, warmup=3, calls=8)
        host = {v: host_ms_per_call(c, 50) for v, c in calls.items()}
    med = {v: statistics.median(t) for v, t in got.items()}
    ratio = {v: statistics.median(a / b for a, b in zip(got["default"], got[v])) for v in got}
    row = {"seq": seq, "ms": med, "ratio_to_default": ratio, "host_ms": host}
    summary.setdefault("rows", []).append(row)
    print(json.dumps(row))
with open(os.path.join(out, f"dynamic_host-{model_name}.json"), "w") as f:
    json.dump(summary, f, indent=1)
dist.destroy_process_group()
