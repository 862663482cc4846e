export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
for v in new base; do
  mkdir -p $OUT/$v
  if [ $v = new ]; then P=$PWD; else P=$PWD/.gpurun/base:$PWD; fi
  OUT=$OUT/$v PYTHONPATH=$P timeout 100 python3 benchmarks/bench_packed_decode.py --sweep --batch 1 4 --seq 32768 --depths 1 2 3 --variants "=correction read attend|=reference linear" > $OUT/$v/sweep.log 2>&1; echo "$v rc=$? $(( $(date +%s) - S )) s"
  grep -E "^B=" $OUT/$v/sweep.log | cut -c1-100
done
echo "=== end $(( $(date +%s) - S )) s"
