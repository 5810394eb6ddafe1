# one GPU: the profile command's copy-bandwidth measurement (profiling/command.measure_copy_gbps) on its
# own, three times, beside the stand-in diagnostic's clone row (standin_copies-...-2026-11-29.json: 4084 GB/s)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python - <<'PY' 2>&1 | tee $OUT/profile_copy.log
import torch
from overlap_compile.profiling.bench import Bench
from overlap_compile.profiling.command import measure_copy_gbps
from overlap_compile.predictor import loaded_profile
from overlap_compile.predictor.models import copy_gbps
b = Bench("cuda:0", iters=5)
got = [measure_copy_gbps(b, "cuda:0", torch.bfloat16) for _ in range(3)]
print(torch.cuda.get_device_name(0), torch.__version__, "measure_copy_gbps:", got, "h200 profile:", copy_gbps(loaded_profile("h200")))
PY
