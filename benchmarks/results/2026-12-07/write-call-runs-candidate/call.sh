# device call (about 240 s): a token-sparse prompt's residual writes (depths 2-3) with the groups
# that are runs of the call's indices loaded by index, against HEAD's write in one process, caches
# checked bit-equal first (bench_packed_prefill.py --write-against). From the repo root at HEAD,
# carry [".gpurun"], with the candidate's packed_write.py in .gpurun:
#   rm -rf /tmp/cand && mkdir /tmp/cand && git archive HEAD flashloop_compile | tar -x -C /tmp/cand
#   (cd /tmp/cand && patch -p1 < $OLDPWD/benchmarks/results/2026-12-07/write-call-runs-candidate/call_runs.patch)
#   cp /tmp/cand/flashloop_compile/lowering/kernels/packed_write.py .gpurun/cand_write.py
# and the same with call_runs_v_early_d3.patch into .gpurun/cand_write3.py (both variants are timed)
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
for w in cand_write cand_write3; do
  mkdir -p $OUT/$w
  OUT=$OUT/$w timeout 200 python3 benchmarks/bench_packed_prefill.py --tokens 8192 32768 --repeats 10 --write-against .gpurun/$w.py > $OUT/$w/write.log 2>&1
  echo "$w rc=$? $(( $(date +%s) - S )) s"; grep -E "write d|rror|failed" $OUT/$w/write.log | cut -c1-120
done
