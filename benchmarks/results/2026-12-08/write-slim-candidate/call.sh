# device call (about 200 s): the slim write (4 and 8 warps) against HEAD's, one process, caches checked bit-equal
# first. From the repo root at HEAD, carry [".gpurun"], with the candidate's packed_write.py (and
# its codec helpers) in .gpurun/cand_slim.py:
#   rm -rf /tmp/cand && mkdir /tmp/cand && git archive HEAD | tar -x -C /tmp/cand
#   (cd /tmp/cand && git apply $OLDPWD/benchmarks/results/2026-12-08/write-slim-candidate/write_slim.patch)
#   python3 - <<'PY'  # packed_write.py with the candidate's _codes, _div15 and _params after __all__
#   w = open('/tmp/cand/flashloop_compile/lowering/kernels/packed_write.py').read()
#   c = open('/tmp/cand/flashloop_compile/lowering/kernels/packed_codec.py').read()
#   f = c[c.index('@triton.jit\ndef _codes('):c.index('@triton.jit\ndef _reconstruct(')]
#   a = '__all__ = ["launch_packed_kv_write"]\n'
#   open('.gpurun/cand_slim.py', 'w').write(w.replace(a, a + '\n\n' + f))
#   PY
#   sed 's/num_warps=(1 if rt else 4)/num_warps=(1 if rt else 8)/' .gpurun/cand_slim.py > .gpurun/cand_slim8.py
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
for w in cand_slim cand_slim8; do
  mkdir -p $OUT/$w
  OUT=$OUT/$w timeout 200 python3 benchmarks/bench_packed_prefill.py --tokens 32768 --repeats 10 --write-against .gpurun/$w.py > $OUT/$w/write.log 2>&1
  echo "$w rc=$? $(( $(date +%s) - S )) s"; grep -E "write d|rror|failed" $OUT/$w/write.log | cut -c1-120
done
