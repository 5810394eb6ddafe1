# one GPU: what the comm-free bound's stand-in copies cost (benchmarks/diagnostics/standin_copies.py)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv | tail -1
python benchmarks/diagnostics/standin_copies.py --out $OUT 2>&1 | tee $OUT/standin_copies.log | tail -40
