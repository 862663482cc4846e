export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
C=$(cat .gpurun/COMMIT)
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, torch._inductor.config as c; print('torch', torch.__version__, 'enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
# 1. the patched tree's decode GPU tests (compiled == eager, replay == eager)
PYTHONPATH=$PWD timeout 170 python3 -m pytest -m gpu -q -n 8 tests/gpu/test_packed_gpu.py tests/gpu/test_sparse_decode_gpu.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s) - S )) s"; tail -3 $OUT/gpu_tests.log | cut -c1-200
# 2. the write candidate against HEAD's write (HEAD's package)
mkdir -p $OUT/write
OUT=$OUT/write PYTHONPATH=$PWD/.gpurun/base:$PWD timeout 150 python3 benchmarks/bench_packed_prefill.py --tokens 32768 --repeats 10 --write-against .gpurun/cand_write2.py > $OUT/write/write.log 2>&1
echo "write rc=$? $(( $(date +%s) - S )) s"; grep -E "write d|rror|failed" $OUT/write/write.log | cut -c1-120
# 3. the 1x32K all-on step, PDL then HEAD, each its own process
for t in cand base; do
  R=$(( 530 - ($(date +%s) - S) )); [ $R -lt 90 ] && { echo "skip $t: $R s left"; continue; }
  mkdir -p $OUT/$t
  if [ $t = base ]; then PP=$PWD/.gpurun/base:$PWD; FC=$C; else PP=$PWD; FC=$C+pdl; fi
  OUT=$OUT/$t PYTHONPATH=$PP FLASHLOOP_COMMIT=$FC timeout $R python3 benchmarks/bench_decode.py --shapes 1x32768 --no-dense-whole --configs sparse+quant --profile 1 --deadline $(( R - 5 )) >> $OUT/$t/decode.log 2>&1
  echo "$t rc=$? $(( $(date +%s) - S )) s"
  grep -E "gpu |glue|attention as a whole|launch" $OUT/$t/decode.log | tail -4 | cut -c1-150
done
echo "=== end $(( $(date +%s) - S )) s"
