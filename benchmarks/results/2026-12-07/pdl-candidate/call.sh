# device calls for the programmatic-dependent-launch candidate (pdl.patch), run from the repo root
# with the patch applied and HEAD's package in .gpurun/base, carry [".gpurun"]:
#   rm -rf .gpurun/base && mkdir -p .gpurun/base && git archive HEAD flashloop_compile | tar -x -C .gpurun/base
#   git rev-parse --short HEAD > .gpurun/COMMIT
#   git apply benchmarks/results/2026-12-07/pdl-candidate/pdl.patch
# MODE=tests (about 250 s): torch's Inductor has the option, then the GPU tests on the patched tree
# MODE=step  (about 420 s): the 1x32K all-on step, patched / HEAD / patched / HEAD, each its own process
# MODE=dense (about 250 s): SHAPE (default 1x32768) dense then all on at 1x8K, patched / HEAD
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat .gpurun/COMMIT)
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import torch, torch._inductor.config as c; print('torch', torch.__version__, 'inductor triton.enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
run() {  # run TREE CONFIGS SHAPE
  R=$(( 580 - ($(date +%s) - S) )); [ $R -lt 100 ] && { echo "skip $1 $2 $3: $R s left"; return; }
  mkdir -p $OUT/$1
  if [ $1 = base ]; then PP=$PWD/.gpurun/base:$PWD; FC=$C; else PP=$PWD; FC=$C+pdl; fi
  OUT=$OUT/$1 PYTHONPATH=$PP FLASHLOOP_COMMIT=$FC timeout $R python3 benchmarks/bench_decode.py --shapes $3 --no-dense-whole --configs $2 --profile 1 --deadline $(( R - 5 )) >> $OUT/$1/decode.log 2>&1
  echo "$1 $2 $3 rc=$? $(( $(date +%s) - S )) s"
  grep -E "gpu |glue|attention as a whole|launches" $OUT/$1/decode.log | tail -4 | cut -c1-150
}
case ${MODE:-tests} in
  tests)
    PYTHONPATH=$PWD timeout 330 python3 -m pytest -m gpu -q -rf -n 8 tests/gpu > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$? $(( $(date +%s) - S )) s"
    tail -5 $OUT/gpu_tests.log | cut -c1-200 ;;
  step)
    for t in cand base cand base; do run $t sparse+quant 1x32768; done ;;
  dense)
    for t in cand base; do run $t dense ${SHAPE:-1x32768}; done
    for t in cand base; do run $t sparse+quant 1x8192; done ;;
esac
echo "=== end $(( $(date +%s) - S )) s"
