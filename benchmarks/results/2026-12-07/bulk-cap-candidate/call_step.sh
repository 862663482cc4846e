export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
for v in cap base; do
  mkdir -p $OUT/$v
  OUT=$OUT/$v PYTHONPATH=$PWD/.gpurun/$v:$PWD FLASHLOOP_COMMIT=$(cat .gpurun/COMMIT)-$v timeout 150 python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant --profile 1 --deadline 145 > $OUT/$v/decode.log 2>&1; echo "$v rc=$?"
  grep -E "gpu sparse|decode_bulk|attention as a whole" $OUT/$v/decode.log | tail -3 | cut -c1-160
done
echo "=== end $(( $(date +%s) - S )) s"
