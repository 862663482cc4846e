# four device calls on one warm H100, commit ff3eb82 (each config in its own process, --isolate)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASHLOOP_COMMIT=ff3eb82
python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant,dense --profile 1 --deadline 215
python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs quant,sparse,sparse+quant+reuse --profile 1 --deadline 300
python3 benchmarks/bench_decode.py --shapes 1x8192,4x8192 --no-dense-whole --configs sparse+quant,dense --profile 1 --deadline 225   # 4x8192 skipped (deadline)
python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant,dense --profile 1 --deadline 150    # dense again; sparse+quant skipped (deadline)
