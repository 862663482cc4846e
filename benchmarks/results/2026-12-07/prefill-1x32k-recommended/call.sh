export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FLASHLOOP_COMMIT=c06f84e
S=$(date +%s)
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for N in reg128 cap168; do
  OUT=$OUT/$N timeout 90 python3 benchmarks/bench_packed_prefill.py --tokens 32768 --repeats 10 --write-against .gpurun/w_$N.py > $OUT/$N.log 2>&1; echo "$N rc=$? $(( $(date +%s) - S )) s"
  grep -E "write d. only|rror" $OUT/$N.log | grep -v -i warn | cut -c1-110 | tail -8
done
L=$(( 575 - ($(date +%s) - S) ))
python3 benchmarks/bench_prefill.py --shapes 1x32768 --configs dense,all_on,all-on@retention=1.0/0.1,token_sparse --profile 1 --repeat 2 --deadline $L > $OUT/prefill.log 2>&1; echo "prefill rc=$? $(( $(date +%s) - S )) s"
python3 - <<'P'
import json, os
for l in open(os.environ["OUT"] + "/prefill.jsonl"):
    r = json.loads(l)
    if r.get("kind") == "prefill":
        print(r["config"], "%.1f" % r["ms"], r.get("speedup_vs_dense"), "compile %.0f" % r.get("compile_s", 0))
    elif r.get("kind") != "rates":
        print(str(r)[:300])
P
grep -E "^  (parts|profile)|packed|write" $OUT/prefill.log | head -40 | cut -c1-200
echo "=== end $(( $(date +%s) - S )) s"
