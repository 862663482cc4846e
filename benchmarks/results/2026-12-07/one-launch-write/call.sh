export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
mkdir -p $OUT/test
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_packed_gpu.py -x -p no:cacheprovider > $OUT/test/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/test/pytest.log
echo "=== $(( $(date +%s) - S )) s"
for v in new base; do
  mkdir -p $OUT/$v
  if [ $v = new ]; then P=$PWD; else P=$PWD/.gpurun/base:$PWD; fi
  OUT=$OUT/$v PYTHONPATH=$P FLASHLOOP_COMMIT=dce13d5-$v timeout 140 python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant --profile 1 --deadline 135 > $OUT/$v/decode.log 2>&1; echo "$v rc=$?"
  grep -E "gpu sparse|  write |launches per step|attention as a whole" $OUT/$v/decode.log | tail -4 | cut -c1-160
done
echo "=== end $(( $(date +%s) - S )) s"
