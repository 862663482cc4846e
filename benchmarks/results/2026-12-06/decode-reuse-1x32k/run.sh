set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASHLOOP_COMMIT=ede188e
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv

python3 benchmarks/bench_decode.py --shapes 1x32768,4x32768 --no-dense-whole --configs dense,sparse+quant,sparse+quant+reuse --profile 1 --deadline 560 2>&1 | grep -v Warning | tail -60
ls $OUT
