# device call (about 80 s): the candidate's write against HEAD's, bit-equal check first
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT
timeout 200 python3 benchmarks/bench_packed_prefill.py --tokens 8192 32768 --repeats 10 --write-against .gpurun/old_write.py > $OUT/write_ab.log 2>&1; echo "write_ab rc=$? $(( $(date +%s) - S )) s"
grep -E "write d. only|rror" $OUT/write_ab.log | grep -v -i warn | cut -c1-120 | tail -16
