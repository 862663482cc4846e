export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
mkdir -p $OUT/base $OUT/loop $OUT/write
S=$(date +%s)
left() { echo $(( 560 - ($(date +%s) - S) )); }
OUT=$OUT/write PYTHONPATH=$PWD timeout 120 python3 benchmarks/bench_packed_prefill.py --tokens 32768 --repeats 10 --write-against .gpurun/old_write.py > $OUT/write/write.log 2>&1; echo "write rc=$?"; grep -E "write|Error|rror" $OUT/write/write.log | cut -c1-150
echo "=== write $(( $(date +%s) - S )) s"
for v in base loop; do
  if [ $v = base ]; then VAR="=correction read attend"; else VAR="correction read attend t4 s3|correction read attend t8 s3"; fi
  OUT=$OUT/$v PYTHONPATH=$PWD/.gpurun/$v timeout 110 python3 .gpurun/bench_loop/bench_packed_decode.py --sweep --seq 32768 --batch 1 4 --depths 2 3 --variants "$VAR" > $OUT/$v/sweep.log 2>&1; echo "$v sweep rc=$?"
  grep -E "correction read attend|Error|error" $OUT/$v/sweep.log | grep -v -i warn | cut -c1-170
  echo "=== $v $(( $(date +%s) - S )) s"
done
for v in loop base; do
  C=$(cat .gpurun/COMMIT); [ $v = loop ] && C=$C+looped
  R=$(left); [ $R -lt 90 ] && break
  OUT=$OUT/$v PYTHONPATH=$PWD/.gpurun/$v FLASHLOOP_COMMIT=$C timeout $R python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant --profile 1 --deadline $(( R - 5 )) > $OUT/$v/decode.log 2>&1; echo "$v step rc=$?"
  grep -E "gpu |^    [a-z]|sparse\+quant" $OUT/$v/decode.log | grep -v -i warn | head -24 | cut -c1-160
done
echo "=== end $(( $(date +%s) - S )) s"
