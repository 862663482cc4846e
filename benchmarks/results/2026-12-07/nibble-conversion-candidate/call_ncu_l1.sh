export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.gpurun/base:$PWD
S=$(date +%s)
M=l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_lg.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_local_op_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_global_ld.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__throughput.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts.avg.pct_of_peak_sustained_elapsed,l1tex__lsuin_requests.avg.pct_of_peak_sustained_elapsed,l1tex__f_wavefronts.avg.pct_of_peak_sustained_elapsed,l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__t_output_wavefronts_pipe_lsu_mem_global_op_ld.sum
for d in 2; do
  mkdir -p $OUT/d$d
  timeout 120 ncu --clock-control none -k regex:_read_attend_kernel -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section SourceCounters --metrics $M \
    python3 benchmarks/bench_packed_decode.py --sweep --batch 1 --seq 32768 --depths $d --repeats 2 --warmup 0 --variants "=correction read attend" > $OUT/d$d/ncu.txt 2>&1
  echo "d$d rc=$? $(( $(date +%s) - S )) s"
  grep -E "wavefronts|requests|sectors|inst_executed|bank_conflicts|throughput|lsuin|xbar" $OUT/d$d/ncu.txt | head -24
done
