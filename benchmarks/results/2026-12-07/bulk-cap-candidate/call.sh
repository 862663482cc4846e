export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat .gpurun/COMMIT)
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
mkdir -p $OUT/sweep
OUT=$OUT/sweep PYTHONPATH=$PWD timeout 170 python3 benchmarks/bench_packed_decode.py --sweep --seq 32768 --batch 1 4 --depths 0 1 2 3 --variants "=fast tail4|fast nreg" > $OUT/sweep/sweep.log 2>&1; echo "sweep rc=$?"
grep -E "fast|rror" $OUT/sweep/sweep.log | grep -v -i warn | cut -c1-150 | head -60
echo "=== sweep $(( $(date +%s) - S )) s"
for run in cap:sparse+quant base:sparse+quant cap:quant base:quant; do
  v=${run%%:*}; cfg=${run#*:}
  R=$(( 575 - ($(date +%s) - S) )); [ $R -lt 100 ] && break
  mkdir -p $OUT/$v
  if [ $v = cap ]; then PP=$PWD/.gpurun/cap:$PWD; FC=$C+cap168-168-0-0; else PP=$PWD; FC=$C; fi
  OUT=$OUT/$v PYTHONPATH=$PP FLASHLOOP_COMMIT=$FC timeout $R python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs $cfg --profile 1 --deadline $(( R - 5 )) >> $OUT/$v/decode.log 2>&1; echo "$v $cfg rc=$?"
  grep -E "gpu $cfg |decode_bulk|attention as a whole" $OUT/$v/decode.log | tail -3 | cut -c1-140
done
echo "=== end $(( $(date +%s) - S )) s"
