export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader
mkdir -p $OUT/test $OUT/ncu
PYTHONPATH=$PWD/.gpurun/base:$PWD timeout 130 python3 -m pytest -q -m gpu tests/gpu/test_packed_gpu.py tests/gpu/test_reuse_gpu.py -k "read_attend or packed_reuse" -p no:cacheprovider > $OUT/test/pytest.log 2>&1; echo "pytest rc=$?"; tail -4 $OUT/test/pytest.log
echo "=== $(( $(date +%s) - S )) s"
# hardware counters of the read-and-attend correction at B1 x 32K, depths 2 and 3 (base tree)
for d in 2 3; do
  mkdir -p $OUT/ncu/d$d
  PYTHONPATH=$PWD/.gpurun/base OUT=$OUT/ncu/d$d KERNELS='_read_attend_kernel' VARIANTS='=correction read attend' DEPTHS=$d BATCH=1 COUNT=3 NCU_TIMEOUT=100 timeout 110 bash scripts/ncu_kernels.sh 2>&1 | tail -8
  echo "=== $(( $(date +%s) - S )) s"
done
