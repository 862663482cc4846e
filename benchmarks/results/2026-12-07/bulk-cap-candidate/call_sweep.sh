export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
mkdir -p $OUT/sweep $OUT/test
OUT=$OUT/sweep PYTHONPATH=$PWD timeout 120 python3 benchmarks/bench_packed_decode.py --sweep --seq 32768 --batch 1 --depths 0 1 --variants "=fast tail4|fast nreg" > $OUT/sweep/sweep.log 2>&1; echo "sweep rc=$?"
grep -E "fast|rror" $OUT/sweep/sweep.log | grep -v -i warn | cut -c1-150 | head -24
echo "=== $(( $(date +%s) - S )) s"
PYTHONPATH=$PWD timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_packed_gpu.py -k read_attend -x -p no:cacheprovider > $OUT/test/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/test/pytest.log
echo "=== $(( $(date +%s) - S )) s"
