# device call (about 450 s): the read-and-attend correction with its first loads issued together,
# against HEAD (run from the repo root with the patch applied and HEAD's package in .gpurun/base:
#   mkdir -p .gpurun/base && git archive HEAD flashloop_compile | tar -x -C .gpurun/base
#   git apply benchmarks/results/2026-12-07/correction-early-loads-candidate/early_loads.patch
# device: bash benchmarks/results/2026-12-07/correction-early-loads-candidate/call.sh, carry [".gpurun"])
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
for tree in base cand; do
  mkdir -p $OUT/$tree
  if [ $tree = base ]; then P=$PWD/.gpurun/base:$PWD; else P=$PWD; fi
  PYTHONPATH=$P OUT=$OUT/$tree timeout 230 python3 benchmarks/bench_packed_decode.py --sweep --batch 1 4 --seq 32768 --depths 2 3 --variants "=correction read attend" > $OUT/$tree/sweep.log 2>&1
  echo "$tree rc=$? $(( $(date +%s) - S )) s"
  grep -E "correction read attend|rror" $OUT/$tree/sweep.log | grep -v -i warn | cut -c1-140
done
