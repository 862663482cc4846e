export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
mkdir -p $OUT/ncu
OUT=$OUT/ncu KERNELS='_select_first_kernel|_select_level_kernel|_select_compact_kernel|_decode_bulk_kernel|_mma_scores_kernel|_mma_pv_kernel' VARIANTS='=fast tail4|=reference linear' DEPTHS=1 BATCH=1 COUNT=10 NCU_TIMEOUT=120 timeout 260 bash scripts/ncu_kernels.sh 2>&1 | tail -16 | cut -c1-260
echo "=== end $(( $(date +%s) - S )) s"
