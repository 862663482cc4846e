#!/usr/bin/env bash
# One device call (<= 10 minutes) on an H200: the GPU tests, then the decode and prefill
# benchmarks in priority order under one deadline; results land under $OUT (JSON lines + logs).
# Items that do not fit are recorded as skipped, so the next call can take them.
#
#   bash scripts/gpu_suite.sh              # everything, in priority order, 540 s
#   SUITE=decode SHAPES=4x32768 bash scripts/gpu_suite.sh
#   SUITE=decode SHAPES=4x32768 DECODE_ARGS="--no-dense-whole --profile 3" bash scripts/gpu_suite.sh  # + 3 profiled
#     replays per config: device ms per kernel bucket (rows' "profile" in $OUT/decode.jsonl, tables in decode.log)
#   SUITE=diag,ops,prefill PREFILL_SHAPES=1x8192,1x4096 bash scripts/gpu_suite.sh   # stages: diag tests sweep ops decode prefill generate
#
# The interpreter must be off for compiled kernels: tests/conftest.py only turns it on without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # no install needed
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
SUITE=${SUITE:-tests,decode,prefill}
DEADLINE=${DEADLINE:-540}
start=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }

if [[ $SUITE == *diag* ]]; then
  # where a dynamic prompt length gets specialized on CUDA (the engine test's failure mode)
  timeout 150 python3 scripts/diag_specialization.py -m gpu tests/gpu/test_engine_gpu.py -k "quant and not sparse" -x \
    -p no:cacheprovider > "$OUT/diag.log" 2>&1
  grep -A3 "=== while propagating" "$OUT/diag.log" | head -20
fi
if [[ $SUITE == *tests* ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -q -n 4 --durations=8 ${TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
if [[ $SUITE == *sweep* ]]; then
  # packed decode attention launch parameters; the best (summed over the swept shapes) is printed:
  # a new default is an edit of packed_decode.FAST_DECODE
  # SWEEP_ARGS: more arguments (e.g. --profile 5: device us per kernel of each variant)
  # SWEEP_VARIANTS: a name filter, alternatives separated by | (default '': the whole grid, about 150 s:
  # the generic path, the bulk kernel's launch points, four packed_read rows and two packed-reference
  # rows, which are not picked as tuning; the JSON is saved after each batch size)
  timeout 200 python3 benchmarks/bench_packed_decode.py --sweep --batch 1 4 --seq 32768 --depths 1 3 \
    --repeats 20 --warmup 3 --variants "${SWEEP_VARIANTS-}" ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1
  grep "^best" "$OUT/sweep.log"
  best=$(python3 - "$OUT/packed_sweep.json" <<'EOF2'
import json, sys, collections
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "us" in r and r.get("kind", "attention") == "attention"]
keys = {(r["batch"], r["depth"]) for r in rows}
total = collections.defaultdict(float); seen = collections.Counter()
for r in rows:
    total[r["variant"]] += r["us"]; seen[r["variant"]] += 1
name = min((v for v in total if seen[v] == len(keys)), key=total.get)  # "generic" wins: fast path off
print(json.dumps(next(r["tuning"] for r in rows if r["variant"] == name)))
EOF2
)
  [[ -n $best ]] && echo "best fast decode tuning: $best"
fi
if [[ $SUITE == *ops* ]]; then
  # per-site op times of a quantized prefill vs causal SDPA
  timeout 150 python3 benchmarks/bench_packed_prefill.py --tokens 4096 8192 --sweep > "$OUT/packed_prefill.log" 2>&1
  tail -20 "$OUT/packed_prefill.log"
fi
if [[ $SUITE == *decode* ]] && (( $(left) > 150 )); then
  timeout $(( $(left) - 20 )) python3 benchmarks/bench_decode.py --shapes "${SHAPES:-1x32768,4x32768,1x8192,4x8192}" ${DECODE_ARGS:-} \
    --deadline $(( $(left) - 140 )) 2>&1 | tail -60 > "$OUT/decode.log"
  tail -5 "$OUT/decode.log"
fi
if [[ $SUITE == *prefill* ]] && (( $(left) > 150 )); then
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py --shapes "${PREFILL_SHAPES:-1x8192,1x32768,1x4096,4x4096}" \
    --deadline $(( $(left) - 15 )) 2>&1 | tail -60 > "$OUT/prefill.log"  # the bench itself needs 150 s per shape
  tail -5 "$OUT/prefill.log"
fi
if [[ $SUITE == *generate* ]] && (( $(left) > 200 )); then
  # end-to-end generation
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_generate.py --deadline $(( $(left) - 40 )) ${GENERATE_ARGS:-} \
    > "$OUT/generate.log" 2>&1
  grep -v '^{' "$OUT/generate.log" | tail -25
fi
echo "suite done in $(( $(date +%s) - start )) s"
