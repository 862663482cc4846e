export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASHLOOP_COMMIT=948c391
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
SHAPES=${SHAPES:-1x32768,4x32768}; CONFIGS=${CONFIGS:-dense,sparse+quant}; DL=${DL:-560}
python3 benchmarks/bench_decode.py --shapes $SHAPES --no-dense-whole --configs $CONFIGS --profile 1 --deadline $DL > $OUT/decode.log 2>&1; echo "decode rc=$? $(( $(date +%s) - S )) s"
cp $OUT/../decode.jsonl $OUT/ 2>/dev/null
grep -E "gpu |^    [a-z]|step|skipped|rror" $OUT/decode.log | grep -v -i warn | head -60 | cut -c1-170
ls $OUT
echo "=== end $(( $(date +%s) - S )) s"
