export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat .gpurun/COMMIT)
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
PYTHONPATH=$PWD timeout 120 python3 .gpurun/regs.py 2>&1 | grep -v -i warn | tail -5
echo "=== regs $(( $(date +%s) - S )) s"
for v in new base new base; do
  R=$(( 570 - ($(date +%s) - S) )); [ $R -lt 110 ] && break
  mkdir -p $OUT/$v
  if [ $v = base ]; then PP=$PWD/.gpurun/base:$PWD; FC=$C~1; else PP=$PWD; FC=$C; fi
  OUT=$OUT/$v PYTHONPATH=$PP FLASHLOOP_COMMIT=$FC timeout $R python3 benchmarks/bench_decode.py --shapes ${SHAPE:-1x32768} --no-dense-whole --configs sparse+quant --profile 1 --deadline $(( R - 5 )) >> $OUT/$v/decode.log 2>&1; echo "$v rc=$?"
  grep -E "gpu sparse|correction |attention as a whole" $OUT/$v/decode.log | tail -3 | cut -c1-140
done
echo "=== end $(( $(date +%s) - S )) s"
