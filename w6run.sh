#!/bin/bash
# One call: W6a and W6b, ours first, then the peers.
export PYTHONPATH=$(ls -d $PWD/packages/*/src | paste -sd:) BENCH_COMMIT=${BENCH_COMMIT:-unknown}
nvidia-smi --query-gpu=name --format=csv,noheader
b() { python3 benchmarks/offload_bench.py --warmup 2 "$@" >> $OUT/bench.log 2>&1; }
b --workloads W6a --kinds ours --out $OUT/a1 --time-limit-s 150
b --workloads W6b --kinds ours --out $OUT/b1 --time-limit-s 120 --profile-dir $OUT/prof
b --workloads W6a --kinds fsdp2_ckpt,fsdp2_ckpt_host,full_gpu_ckpt --out $OUT/a2 --time-limit-s 190
b --workloads W6b --kinds fsdp2_ckpt,fsdp2_ckpt_host --out $OUT/b2 --time-limit-s 110
grep "\[bench\]" $OUT/bench.log | cut -c1-2500
rm -f $OUT/prof/trace_*.json.gz
