export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
mkdir -p $OUT/sweep
OUT=$OUT/sweep PYTHONPATH=$PWD timeout 200 python3 benchmarks/bench_packed_decode.py --sweep --seq 32768 --batch 1 --depths 0 1 --variants "=fast tail4|fast nreg" > $OUT/sweep/sweep.log 2>&1; echo "sweep rc=$?"
grep -E "fast|rror" $OUT/sweep/sweep.log | grep -v -i warn | cut -c1-150 | head -24
echo "=== $(( $(date +%s) - S )) s"
