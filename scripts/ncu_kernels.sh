#!/usr/bin/env bash
# Hardware counters (Nsight Compute) of the packed decode kernels on the H200, from one run of
# bench_packed_decode's sweep (the variants it checks against ATen before timing), for what a
# sweep cannot say: whether a kernel is bound by DRAM, by issue, or by waiting (the warp stall
# reasons per issued instruction). The device runs on Firecracker, where ncu reads the counters;
# the clocks are left alone (--clock-control none). One device call (a few minutes):
#
#   OUT=$OUT/ncu bash scripts/ncu_kernels.sh                      # B4 x 32K, depth 1
#   KERNELS='_read_bulk_kernel' VARIANTS='=correction read then correct' DEPTHS=3 bash scripts/ncu_kernels.sh
#
# $OUT/ncu.txt: ncu's report; the table at the end: scripts/ncu_summary.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/ncu}
mkdir -p "$OUT"
KERNELS=${KERNELS:-_decode_bulk_kernel|_scores_linear_kernel|_pv_linear_kernel|_read_bulk_kernel|_correction_kernel}
VARIANTS=${VARIANTS:-=fast bn64 w1 s3 x8|=reference linear|=correction read then correct}
STALLS="long_scoreboard barrier short_scoreboard math_pipe_throttle wait not_selected selected mio_throttle lg_throttle
        dispatch_stall no_instruction branch_resolving imc_miss drain membar sleeping tex_throttle"
METRICS=$(for s in $STALLS; do printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' "$s"; done)
IFS='|' read -ra VARS <<< "$VARIANTS"
: > "$OUT/ncu.txt"
for v in "${VARS[@]}"; do  # one ncu run per variant: -c counts the matching launches of the whole run
  timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --target-processes all -k "regex:$KERNELS" -c "${COUNT:-6}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --metrics "${METRICS%,}" \
    python3 benchmarks/bench_packed_decode.py --sweep --batch ${BATCH:-4} --seq 32768 --depths ${DEPTHS:-1} \
    --repeats 20 --warmup 0 --variants "$v" >> "$OUT/ncu.txt" 2>&1
  echo "$v: ncu rc $?"
done
python3 scripts/ncu_summary.py "$OUT/ncu.txt" | tee "$OUT/ncu_summary.txt"
