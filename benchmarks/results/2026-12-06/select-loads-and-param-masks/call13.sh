export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
mkdir -p $OUT/new $OUT/base
S=$(date +%s)
left() { echo $(( 590 - ($(date +%s) - S) )); }
PYTHONPATH=$PWD timeout 110 python3 .gpurun/sel_ab.py > $OUT/sel_ab.log 2>&1; echo rc=$?; grep -v -i warn $OUT/sel_ab.log | tail -8 | cut -c1-260
echo "=== sel $(( $(date +%s) - S )) s"
for v in base new; do
  if [ $v = base ]; then PP=$PWD/.gpurun/base; else PP=$PWD; fi
  LABEL=$v PYTHONPATH=$PP:$PWD/benchmarks timeout 100 python3 .gpurun/corr_site.py > $OUT/corr_${v}.log 2>&1; echo "$v rc=$?"
  grep -E "site|Error" $OUT/corr_${v}.log | cut -c1-200
done
echo "=== corr $(( $(date +%s) - S )) s"
for v in new base; do
  if [ $v = base ]; then PP=$PWD/.gpurun/base; C=$(cat .gpurun/COMMIT); else PP=$PWD; C=$(cat .gpurun/COMMIT)+sel+mask; fi
  R=$(left); [ $R -lt 100 ] && break
  OUT=$OUT/$v PYTHONPATH=$PP FLASHLOOP_COMMIT=$C timeout $R python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant --profile 1 --deadline $(( R - 5 )) > $OUT/$v/decode.log 2>&1; echo "$v rc=$?"
  grep -E "gpu |^    [a-z]" $OUT/$v/decode.log | grep -v -i warn | head -24 | cut -c1-160
done
echo "=== end $(( $(date +%s) - S )) s"
