#!/usr/bin/env bash
# One device call (<= 10 minutes) on an H200: the GPU tests, then the decode and prefill
# benchmarks in priority order under one deadline; results land under $OUT (JSON lines + logs).
# Items that do not fit are recorded as skipped, so the next call can take them.
#
#   bash scripts/gpu_suite.sh              # everything, in priority order, 540 s
#   SUITE=decode SHAPES=4x32768 bash scripts/gpu_suite.sh
#
# The interpreter must be off for compiled kernels: tests/conftest.py only turns it on without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
SUITE=${SUITE:-tests,decode,prefill}
DEADLINE=${DEADLINE:-540}
start=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - start) )); }

if [[ $SUITE == *tests* ]]; then
  timeout 150 python3 -m pytest -m gpu -q -x tests/gpu 2>&1 | tail -40 > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log"
fi
if [[ $SUITE == *decode* ]] && (( $(left) > 150 )); then
  timeout $(( $(left) - 20 )) python3 benchmarks/bench_decode.py --shapes "${SHAPES:-1x32768,4x32768,1x8192,4x8192}" \
    --deadline $(( $(left) - 140 )) 2>&1 | tail -60 > "$OUT/decode.log"
  tail -5 "$OUT/decode.log"
fi
if [[ $SUITE == *prefill* ]] && (( $(left) > 150 )); then
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_prefill.py --shapes "${PREFILL_SHAPES:-1x8192,1x32768,1x4096,4x4096}" \
    --deadline $(( $(left) - 130 )) 2>&1 | tail -60 > "$OUT/prefill.log"
  tail -5 "$OUT/prefill.log"
fi
echo "suite done in $(( $(date +%s) - start )) s"
