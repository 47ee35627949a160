#!/usr/bin/env bash
# Run the gpu tests or the benchmark's report rows on a CUDA machine, one phase at a time,
# each phase sized to fit one 10-minute call.
#
#   bash benchmarks/gpu_session.sh PHASE [OUT_DIR]
#
# PHASE (times from the rows' wall times, process start included, on an H100 host with 16
# cores; an H200 host with 16 cores is alike):
#   tests    nox -s gpu_tests: every package's gpu-marked tests (gpu_tests.log)    ~6.5 min
#   configs1 W1's defaults (stepped in turn with full GPU too) and full GPU (~1.5 min);
#            W2's defaults and the other configurations of the same numerics: the
#            planner's two fp16 candidates forced, streaming off (~1 min each)     ~5.5 min
#   configs2 the same four configurations at W3 (~1 min each)                      ~4 min
#   configs3 W4's defaults and the two candidates forced (~2.5 min each)           ~7.5 min
#   peers1   full GPU and FSDP2 at W2 and W3                                      ~3.5 min
#   peers2   W4's FSDP2 (2 to 4.5 min; cut at the phase's limit)                  ~2-5 min
#   ladder1  W3: the bf16-master rungs (torchao's numerics, stochastic rounding,
#            8-bit moments) and torchao                                            ~4 min
#   ladder2  the same at W4 (~1.5 min a row)                                       ~6 min
#   ladder3  the same at W5 (~1 min a row)                                         ~4 min
#   w5a      W5 (llama_3b): the defaults, the two candidates forced, streaming off
#            (estimated from W4's rows, ~2 min each; the last cut at the limit)    ~8 min
#   w5b      W5's peers: full GPU, then FSDP2 (estimated; FSDP2 last, cut at the
#            limit)                                                                ~4-7 min
#   w6a      W6a (gpt2_xl 8 x 8192, activations beyond the budget): the defaults, the
#            checkpointing FSDP2 arms (on the device, saved inputs on the host) and
#            checkpointed full GPU (estimated: steps of seconds, 8 a row with warm-up,
#            planning and setup ~1 min; ~1.5-2 min a row, full GPU last, cut at the
#            limit or out of memory)                                               ~6-8 min
#   w6b      W6b (llama_3b 1 x 32768): the defaults and the two checkpointing FSDP2
#            arms (estimated as w6a, ~2 min a row)                                 ~5-6 min
#   bench    every phase above but tests, in turn (a machine without the 10-minute limit)
#   all      tests, then bench
# A bench phase writes each row to OUT_DIR/<workload>_<kind>.json as it is measured and
# OUT_DIR/summary.json after each; then the results table (table.md) and the targets
# (targets.md) over the folder. The rows of several phases' folders make one summary:
#   python benchmarks/offload_bench.py --summary benchmarks/results/summary.json DIR1 DIR2
#   python benchmarks/targets.py --table benchmarks/results/summary.json
#   python benchmarks/targets.py benchmarks/results/summary.json
# OUT_DIR defaults to $OUT, else ./gpu_out. LIMIT (seconds, default 570) bounds a bench
# phase: a row starts only with 30 s left, and is cut at the limit. PROFILE=1 keeps a
# profile and a Chrome trace of 2 steps of each row in OUT_DIR/prof (about 10 s a row
# more). Set BENCH_COMMIT to name the commit where the tree is not a git checkout.
# DRY_RUN=1 prints the commands instead of running them. Without network, nox and
# torchao are installed from WHEELS (default shared/device-wheels, its bench/ for
# torchao) when the interpreter lacks them.
set -euo pipefail
phase=${1:?usage: gpu_session.sh tests|configs1|configs2|configs3|peers1|peers2|ladder1|ladder2|ladder3|w5a|w5b|w6a|w6b|bench|all [OUT_DIR]}
out=${2:-${OUT:-gpu_out}}
root=$(cd "$(dirname "$0")/.." && pwd)
limit=${LIMIT:-570}
wheels=${WHEELS:-$root/shared/device-wheels}
mkdir -p "$out"
srcs=$(ls -d "$root"/packages/*/src | paste -sd:)
export PYTHONPATH="$srcs${PYTHONPATH:+:$PYTHONPATH}"

# run COMMAND...: run it, or print it under DRY_RUN=1.
run() {
  if [ -n "${DRY_RUN:-}" ]; then
    printf '+ %s\n' "$*"
  else
    "$@"
  fi
}

# need MODULE FOLDER: install FOLDER's wheels into a side folder on PYTHONPATH when the
# interpreter cannot import MODULE (a CUDA machine may have no network).
need() {
  if [ -n "${DRY_RUN:-}" ] || python3 -c "import $1" 2>/dev/null; then return 0; fi
  if compgen -G "$2/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/offload-site "$2"/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/offload-site"
  else
    echo "[gpu_session] $1 is not importable and $2 holds no wheels" >&2
  fi
}

# bench WORKLOAD KINDS [OPTION...]: those rows into $out, within what is left of the limit.
bench() {
  local w=$1 kinds=$2
  shift 2
  local left=$((limit - (SECONDS - start)))
  run python3 "$root/benchmarks/offload_bench.py" --workloads "$w" --kinds "$kinds" \
    --out "$out" --time-limit-s "$left" ${PROFILE:+--profile-dir "$out/prof"} "$@" 2>&1 \
    | tee -a "$out/bench.log" | grep -E '^\[bench\]|^\+ ' || true
}

# report: the results table and the targets over every row in $out (CPU only, a second).
report() {
  if [ -n "${DRY_RUN:-}" ] || compgen -G "$out/W*_*.json" > /dev/null; then
    run python3 "$root/benchmarks/targets.py" --table "$out" | tee "$out/table.md"
    run python3 "$root/benchmarks/targets.py" "$out" | tee "$out/targets.md"
  fi
}

start=$SECONDS
case "$phase" in
  tests)
    need nox "$wheels"
    run python3 -m nox -f "$root/noxfile.py" -s gpu_tests -- -q -rA -p no:cacheprovider --durations=15 2>&1 \
      | tee "$out/gpu_tests.log" | tail -40 ;;
  configs1)
    bench W1 ours,full_gpu_master --pair-full-gpu
    bench W2 ours,ours_io_spec1_stream,ours_device_conv,ours_no_stream
    report ;;
  configs2)
    bench W3 ours,ours_io_spec1_stream,ours_device_conv,ours_no_stream
    report ;;
  configs3)
    bench W4 ours,ours_device_conv,ours_io_spec1_stream
    report ;;
  peers1)
    need torchao "$wheels/bench"
    bench W2 full_gpu_master,fsdp2
    bench W3 full_gpu_master,fsdp2
    report ;;
  peers2)
    bench W4 fsdp2
    report ;;
  ladder1 | ladder2 | ladder3)
    need torchao "$wheels/bench"
    w=W$((${phase#ladder} + 2))
    bench "$w" ours_bf16_rn,ours_bf16_sr,ours_bf16_8bit,torchao
    report ;;
  w5a)
    bench W5 ours,ours_io_spec1_stream,ours_device_conv,ours_no_stream
    report ;;
  w5b)
    bench W5 full_gpu_master,fsdp2
    report ;;
  w6a)
    bench W6a ours,fsdp2_ckpt,fsdp2_ckpt_host,full_gpu_ckpt
    report ;;
  w6b)
    bench W6b ours,fsdp2_ckpt,fsdp2_ckpt_host
    report ;;
  bench | all)
    if [ "$phase" = all ]; then bash "$0" tests "$out"; fi
    for p in configs1 configs2 configs3 peers1 peers2 ladder1 ladder2 ladder3 w5a w5b w6a w6b; do
      bash "$0" "$p" "$out"
    done ;;
  *) echo "unknown phase $phase; known: tests configs1 configs2 configs3 peers1 peers2 ladder1 ladder2 ladder3 w5a w5b w6a w6b bench all" >&2; exit 2 ;;
esac
