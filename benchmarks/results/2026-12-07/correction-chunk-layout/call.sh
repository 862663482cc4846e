export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT
# 1. the write's rank compaction (working tree) against HEAD's packed_write.py
PYTHONPATH=$PWD timeout 200 python3 benchmarks/bench_packed_prefill.py --tokens 8192 32768 --repeats 10 --write-against .gpurun/old_write.py > $OUT/write_ab.log 2>&1; echo "write_ab rc=$? $(( $(date +%s) - S )) s"
grep -E "write d. only|rror" $OUT/write_ab.log | grep -v -i warn | cut -c1-120 | tail -16
# 2. the correction: HEAD (base tree) with its warp variants, then the candidate (chunks over warps)
mkdir -p $OUT/base $OUT/cand
PYTHONPATH=$PWD/.gpurun/base:$PWD OUT=$OUT/base timeout 200 python3 benchmarks/bench_packed_decode.py --sweep --batch 1 4 --seq 32768 --depths 2 3 --variants "=correction read attend|=correction read attend w1 bp8|=correction read attend w2 bp16" > $OUT/base/sweep.log 2>&1; echo "base sweep rc=$? $(( $(date +%s) - S )) s"
grep -E "correction read attend|rror" $OUT/base/sweep.log | grep -v -i warn | cut -c1-140 | tail -14
PYTHONPATH=$PWD OUT=$OUT/cand timeout 200 python3 benchmarks/bench_packed_decode.py --sweep --batch 1 4 --seq 32768 --depths 2 3 --variants "=correction read attend|=correction read attend cap128|=correction read attend uncapped" > $OUT/cand/sweep.log 2>&1; echo "cand sweep rc=$? $(( $(date +%s) - S )) s"
grep -E "correction read attend|rror" $OUT/cand/sweep.log | grep -v -i warn | cut -c1-140 | tail -14
