#!/usr/bin/env bash
# One phase of a GPU measurement session, sized to fit one 10-minute device call.
#
#   bash benchmarks/gpu_session.sh PHASE [OUT_DIR]
#
# PHASE:
#   tests   nox -s gpu_tests (every package's gpu-marked tests; the 15 slowest)  ~8 min
#   testsq  nox -s gpu_tests without the speed tests on GPT-2 XL and run.sh's defaults
#           (session 48: 252 of the 472 s): every equivalence and memory test, for a
#           change to the runtime's CUDA path when the session's device time is short
#           (gpu_tests_quick.log)                                           ~4 min
#   w1w3    W1 ours beside full GPU twice (the parameter reads and the probe of e9103c3),
#           then W3 ours_io_spec1_stream (the issue thread) beside FSDP2 and torchao ~7 min
#   w1x     W1 ours and full GPU (fp32 masters), ROUNDS rounds (default 4), the order swapped each round;
#           then pair_ratios.py (the median ratio) and issue_compare.py on each round's
#           two traces (what ours issues more per step)                        ~4 min
#   attnab  W3 ours_io_spec1_stream as by default, planned with fused attention measured
#           at its own shape (BENCH_MEASURE_ATTENTION=1), and with that and operations
#           issued ahead (BENCH_ISSUE_AHEAD=1: the replay's model), alternating, ROUNDS
#           rounds (default 2); then each arm's run means and plans (pin_rows.py) ~1.2 min a row
#   profreads torch's fused host Adam timed the hardware profile's way (32 M parameters in 8 M
#           tensors) and the bench's (64 M in one), each at both sizes, 5 rounds, then
#           the whole profile twice with each host Adam read and when it came
#           (profile_reads.py; profile_reads.log)                              ~1 min
#   thrab   W3 ours_io_spec1_stream beside full GPU by fp32 masters (the source row, all
#           cores), then on its plan with BENCH_HOST_THREADS of each of THRAB_THREADS
#           (default "8 12") and with all cores, ROUNDS rounds (default 1); then each
#           arm's rows (pin_rows.py) and its backward's kernel busy time against their
#           span (compute_fidelity.py; thrab.txt): does a host Adam on fewer cores stretch
#           the backward's issue less (session 48: its CPU side ran 146 ms a step against
#           full GPU's 74, its kernels spanning 160-180 ms for 131 busy)? Each arm's
#           trace also goes through thread_stalls.py (session 51: the main thread waited
#           8.3 ms in a view at the step boundary with host work moved late)  ~4.5 min
#           THRAB_PASSIVE=1 adds an arm on all cores with OMP_WAIT_POLICY=PASSIVE: OpenMP
#           threads that sleep at once after a parallel region instead of spinning, so
#           that the host steps' pools leave the cores to the thread driving backward
#           between kernels (~1 min more a round)
#   rateab  W3 ours_io_spec1_stream planned with the host rate of the blend
#           (BENCH_HOST_RATE=blend, the default until session 56; the first round beside
#           full GPU by fp32 masters, for the floor) and with the kind's own rate samples
#           alone (BENCH_HOST_RATE=samples, the default since: without the cached profile's
#           fused rate, which read 1.40-3.30 Gparam/s on three machines whose processes
#           read 3.5-5.2), alternating, ROUNDS rounds (default 2); with RATEAB_W4=1 also W4
#           with fp32 state each way (about 2 min a row, no FSDP2); then each arm's
#           rows (pin_rows.py; rateab.txt)                     ~1.2 min a W3 row
#   claimab W2 then W3 (CLAIM_WORKLOADS) ours_io_spec1_stream with the host Adam's threads
#           claiming one block at a time (OFFLOAD_HOST_ADAM_CLAIM_BLOCKS=1, the default from
#           session 52; the first row beside its peer) and with numba's equal shares fixed
#           up front (=0), on the first row's plan inputs, alternating, ROUNDS rounds
#           (default 1; onplan_ab); then each arm's rows and its traces' speculative host
#           steps over 30 ms (session 52: the one running when backward ended took 44-109
#           ms, the others 17-26; claim.txt)                ~1.1 min a W2 row, ~0.9 a W3 row
#   cpuprobe W3 ours_io_spec1_stream beside full GPU by fp32 masters, then W2 beside FSDP2
#           (CPUPROBE_WORKLOADS), each with OFFLOAD_HOST_ADAM_CPU_PROBE=1: every host Adam
#           kernel's wall time and the CPU time of the process and of the machine over it;
#           then each row's long kernels and the rest (pin_rows.py) and its traces'
#           speculative host steps over 30 ms (cpuprobe.txt). Sessions 52-53: the kernel
#           running as backward ends took 47-72 ms against 14-17, with blocks claimed or
#           not: did the process lose its cores, and to whom?      ~1.2 min a W3 row, ~1.1 W2
#   slotab  W3 ours_io_spec1_stream with the streamed ring's 3 slots (the default; the first
#           round beside full GPU by fp32 masters, for the floor) and with SLOTAB_SLOTS
#           (default 6; BENCH_STREAM_SLOTS): as many chunks of the streamed regions' state
#           staged in the backward, so that fewer go up at the step boundary, where
#           session 50's W3 forward idled 10 and 7 ms for streamed regions 5 and 11 behind
#           1.4 GB of their state; every arm on the first row's plan inputs
#           (BENCH_PLAN_FROM), alternating, ROUNDS rounds (default 2); then each arm's
#           rows (pin_rows.py) and its profiled traces' compute gaps (slotab.txt)
#                                                                           ~1 min a row
#   lateab  W3 ours_io_spec1_stream planned as by default (host work moved to later
#           regions, solve(late_host_work=True), new in session 51; the first round
#           beside full GPU by fp32 masters, for the floor) and with BENCH_LATE_HOST_WORK=0
#           (the greedy phases' placements: session 51's source row offloaded regions 2,
#           5, 8, ... with host state and its forward waited 21 ms a step for the host),
#           every arm on the first row's plan inputs (BENCH_PLAN_FROM), alternating,
#           ROUNDS rounds (default 1; onplan_ab); then each arm's rows (pin_rows.py) and
#           compute gaps (late.txt; session 51 ran an earlier form of it, ROUNDS=2: on1,
#           off1, off2, on2, in lateab.txt)                                ~1.2 min a row
#   streamcap W3 ours_io_spec1_stream as planned beside full GPU by fp32 masters (the source
#           row), then on its plan (BENCH_PLAN_FROM) with only the first N of its streamed
#           regions streamed and the rest stepped on the host (BENCH_STREAM_MAX=N, each N
#           of STREAMCAP_MAX, default "2 1") and as planned, ROUNDS rounds (default 2);
#           then each arm's rows (pin_rows.py) and compute gaps (streamcap.txt): W3's
#           steps on record rise with the regions streamed (238.5-258.9 ms with two,
#           248.1-260.1 with three, 255.1-276.2 with four) where the simulator sees
#           little difference                                               ~6 min
#   geluab  GPT-2's tanh GELU written out (BENCH_FUSE_GELU=0) and fused into one aten.gelu
#           (as by default from session 37 on), alternating, ROUNDS rounds (default 1): W1 ours with
#           full-GPU training stepped in turn (30 timed steps unless BENCH_STEPS), then W3
#           ours_io_spec1_stream; then pair_ratios.py and pin_rows.py    ~5 min a round
#   s37     W3 ours_io_spec1_stream with full GPU (fp32 masters), FSDP2 and torchao, then W4
#           ours_io_bf16m_spec1_stream with torchao (every kind with one fused tanh GELU
#           unless BENCH_FUSE_GELU=0); w4fsp, W4 beside FSDP2, needs a call of its own:
#           ours took 163 s of it and FSDP2 had not finished 270 s in (session 37) ~6 min
#   streamab W3 ours_io_spec1_stream and ours_io_spec1 (no streamed regions), alternating,
#           ROUNDS rounds (default 2; the first with full GPU by fp32 masters beside it, for
#           the floor); then each kind's rows (pin_rows.py)                  ~1.2 min a row
#   streamsel W3 ours_io_spec1_stream as planned (the first round beside full GPU by fp32
#           masters, for the floor), with the plan's first streamed region stepped on the
#           host and the next host-state region streamed instead (BENCH_STREAM_NOT_FIRST=1:
#           session 40's W3 plan streamed the embeddings' region, whose state's trip is
#           on the critical path), and ours_io_spec1 (nothing streamed), alternating,
#           ROUNDS rounds (default 2); then each arm's rows (pin_rows.py) and its compute
#           stream's gaps over 0.3 ms in the profiled steps (copy_lag.py; streamsel.txt)
#                                                                            ~1.3 min a row
#   writeab W3 ours_io_spec1_stream with resident streamed regions' parameters uploaded
#           after their downloads (BENCH_STREAM_WRITE=0), written on the device (the
#           default from session 38 on; the first round with full GPU by fp32 masters
#           beside it, for the floor), and written with the ring yielding to the h2d stream (BENCH_RING_YIELD=1),
#           ROUNDS rounds (default 1); then pin_rows.py                   ~1.3 min a row
#   w3res   W3 ours_io_spec1_stream planned under RES_BUDGET_GIB (default 120; BENCH_BUDGET_GIB),
#           where nothing leaves the device, beside full GPU by fp32 masters (the
#           kind's trace is trace_W3_full_gpu_master); then issue_compare.py --kernels
#           and kernel_overlap.py --against on the two traces: whether our runtime's own
#           kernels run longer than full-GPU training's with no copy or host step beside
#           them (w3res.txt; targets.py leaves the row out)                    ~3 min
#   scaleab W3 full GPU with its loss unscaled (BENCH_FULL_GPU_SCALER=0, as before session 39),
#           then ours_io_spec1_stream beside full GPU scaled (the default since): step,
#           forward+backward, SM clock and power of each (scaleab.txt)          ~3 min
#   powerab W3 planned under RES_BUDGET_GIB (default 120: nothing offloaded) with fp32 state
#           beside full GPU (fp16 weights and state), then with bf16 moments beside full GPU
#           by torch's mixed-precision recipe (full_gpu_amp: fp32 masters and state under
#           fp16 autocast); each row's step, clock and power (clock_rows.py): does the
#           optimizer state's precision set the draw that lowers ours' clock? ~5 min
#   ampab   W1 ours and W3 ours_io_spec1_stream beside both full-GPU recipes: fp16 weights
#           and state (full_gpu; its weights diverge in a few steps, peer_training.py)
#           and torch's mixed-precision recipe (full_gpu_amp), ROUNDS rounds (default 1);
#           rows record the loss before and after and the scale the scaler ended at;
#           then each row's step, clock and power (clock_rows.py)             ~4 min a round
#   mastab  full-GPU training with fp32 master weights and Adam state (full_gpu_master:
#           fp16 weights, the precision ours keeps; it trains, where full_gpu's fp16 state
#           diverged on the H200 in session 40): W1 ours beside it and full_gpu_amp, W3
#           ours_io_spec1_stream beside it, then W3 planned under RES_BUDGET_GIB (default
#           120: nothing offloaded) beside it; each row's clock and loss (clock_rows.py),
#           and the two resident rows' kernels side by side (issue_compare.py --kernels,
#           kernel_overlap.py --against)                                       ~5.5 min
#   write2  writeab's first two arms once more for W3 (no full GPU), then the same two for
#           W4 ours_io_spec1_stream (fp32 state); WRITE2_WORKLOADS (default "W3 W4")
#           picks                                                            ~9 min
#   w4gelu  W4 ours_io_spec1_stream with the GELU as written (BENCH_FUSE_GELU=0), then
#           fused (the default)                                              ~6 min
#   w1p     W1 ours with full-GPU training stepped in turn in the same process
#           (BENCH_PAIR_FULL_GPU=1, by BENCH_PAIR_RECIPE: default fp32 masters; 60 timed
#           steps unless BENCH_STEPS), then the full-GPU row of W1P_PEER (default
#           full_gpu_master; before session 40, full_gpu) on its own, ROUNDS rounds
#           (default 2); targets.md judges W1 both ways                   ~1.5 min a round
#   w2x     W2 FSDP2 and ours_io_spec1_stream, 20 timed steps, ROUNDS rounds (default 2),
#           the order swapped each round; then pair_ratios.py (the median ratio)  ~2 min a round
#   w2t     W2 FSDP2, then the default (streamed regions issued from their own thread)
#           and BENCH_ISSUE_THREAD=0 alternating twice, 20 timed steps each; W1 ours
#           beside full GPU                                                   ~7 min
#   testsw1 the tests phase, then W1 ours beside full-GPU training              ~7 min
#   trace   the trace package's gpu tests alone (what each leaves allocated)      ~2 min
#   w1      benchmark W1: ours, full_gpu, ablation, fsdp2, torchao            ~4 min
#   w2      benchmark W2: ours, ours_spec, ours_bf16, full_gpu, fsdp2, torchao ~6 min
#   w3      benchmark W3: ours, ours_spec, ours_bf16, full_gpu, fsdp2, torchao ~7 min
#   w4      benchmark W4: ours, ours_bf16m, ours_bf16, torchao (pins ~70-90 GB)    ~9 min
#   diag    step_trace of W2 (phases, streams, allocator snapshot at the peak) ~2 min
#   diag3   step_trace of W3 (phases, streams: where backward idles the device)  ~2 min
#   curve   gpt2_medium loss curves, fp32 vs bf16 host moments, 200 steps each   ~2 min
#   threads host step under contention (host_step_contention.py), then W3 ours with
#           all cores and with one core fewer for the host Adam (BENCH_HOST_THREADS) ~4 min
#   spec    W3 and W2: ours, ours_spec, ours_spec1 (speculation with the single-pass kernel) ~5 min
#   bf16m   bf16 host moments with torch's route and the single-pass kernel: W3, W4    ~7 min
#   fidelity the hardware profile's gpu test (copy contention), then W3 and W2: ours,
#           ours_spec1, fsdp2, torchao (predictions with contention and speculation costs) ~9 min
#   w4b     W4: ours, ours_bf16m1, torchao                                   ~6 min
#   io3     the single phase (unless SKIP_SINGLE=1), then W3: ours, ours_spec1, ours_io, ours_io_spec1, fsdp2,
#           torchao (fp16 across PCIe, converted inside the host step)           ~7 min
#   io2     W2: ours, ours_spec1, ours_io, ours_io_spec1, fsdp2, torchao          ~5 min
#   specio  W3 and W2: ours, ours_spec1, ours_io, ours_io_spec1 (the speculating plans'
#           predictions beside the plain ones')                                ~7 min
#   w4s     W4: ours_io, ours_io_spec1 (speculating the regions whose undo buffers fit in
#           host memory), torchao                                             ~6 min
#   w4m     W4: ours_io_bf16m, ours_io_bf16m_spec1 (fp16 I/O with bf16 host moments: the
#           bf16-moment target), ours_io, torchao                            ~6 min
#   w4f     W4: ours_io, ours_io_bf16m, fsdp2, torchao (every W4 ratio in one call) ~6 min
#   io23    W2 then W3: ours_io, ours_io_spec1, fsdp2, torchao (both workloads' fp16-I/O
#           rows with their peers in one call)                                ~7 min
#   w4idle  W4 ours_io_bf16m_spec1 with every core for the host Adam and with one core
#           fewer (BENCH_HOST_THREADS: the main thread issuing the forward), then torchao:
#           where the host idles after its last step (rows record host_cycle and keep
#           the profiled step's trace; replay_bench.py sets both beside the simulator's) ~6 min
#   probe   the host-step cost probe read again and again: back to back, and with a sleep
#           before each half (host_probe_stability.py)                            ~1 min
#   w4p     probe, then W4 ours_io_bf16m_spec1 and torchao (the plan's host cost from the
#           settled probe)                                                      ~5 min
#   blend   predictions planned with the mean of the two host rates: W4 ours_io_bf16m_spec1
#           and torchao, then W3 and W2 ours_io and ours_io_spec1               ~8 min
#   split   part of W4's host step (bf16 moments, fp16 I/O) streamed through the GPU while
#           the host steps the rest, then torch's fused fp32 step the same way
#           (split_step_bench.py): what a host-state, device-stepped placement would buy ~2 min
#   streamf the streamed-step gpu test, then W4 ours_io_bf16m_spec1_stream with
#           BENCH_STREAM_FRACTION (default 0.5) of the host-state
#           parameters streamed through the GPU, not planned (no profile)     ~5 min
#   stream  W4 ours_io_bf16m_spec1_stream as planned (the planner picks the streamed
#           regions) and torchao, then W3 and W2 ours_io_spec1_stream         ~8 min
#   streamw4 the same machine with and without streaming: W4 ours_io_bf16m_spec1, its
#           _stream kind and torchao; W2 ours_io_spec1 and its _stream kind    ~9 min
#   w4fs    W4 with fp32 state: ours_io, ours_io_stream and FSDP2 (the fp32 W4 targets
#           with streaming)                                                   ~9 min
#   w4fs2   W4 ours_io_stream (fp32 state, its late-landing streamed regions issued
#           in their hooks), FSDP2, torchao and ours_io_bf16m_spec1_stream      ~8 min
#   w4fs3   W4 ours_io_stream and FSDP2 only                                   ~5 min
#   w2s     W2 ours_io_spec1_stream beside FSDP2 and torchao                   ~3 min
#   s24     plans with the solver's local search (8 rounds; off by default since): W3
#           ours_io_spec1_stream beside full GPU, FSDP2 and torchao, then W3 without it,
#           W2 with it beside FSDP2 and torchao, W1 beside full GPU             ~9 min
#   issueab W2 FSDP2, then streamed regions issued on the host worker and from their own
#           thread (BENCH_ISSUE_THREAD=0, then 1), alternating: W2 twice each way, W3 once each
#           way, last W2 with the thread and a core left out of the host Adam
#           (BENCH_HOST_THREADS=15)                                           ~9 min
#   w4issue W4 bf16 moments streamed with torchao, then the same with the streamed regions
#           issued from their own thread (BENCH_ISSUE_THREAD=0, then 1)        ~7 min
#   polishab the solver's local search on and off (BENCH_POLISH_ROUNDS=0), alternating:
#           W3 ours_io_spec1_stream twice each way, then W2 once each way       ~7 min
#   w4fsp   W4 fp32 state speculating where host memory holds undo buffers, streamed
#           (ours_io_spec1_stream), and FSDP2                                  ~8 min
#   pinab   one plan, two trees: PIN_WORKLOAD (default W2) PIN_KIND (default
#           ours_io_spec1_stream) planned and run here once, then that plan run in
#           OTHER_TREE (a copy of another commit, at or after the one that added
#           BENCH_PLAN_FROM) and here, alternating, ROUNDS rounds (default 2); then each
#           row's run mean. BENCH_STEPS as for every phase; W2 with BENCH_STEPS=20 ~9 min
#   specthr SPECTHR_WORKLOAD (default W2; W3 with full GPU by fp32 masters beside its
#           first row, for the floor) planned and run once, then that plan with speculative
#           steps on their own thread (BENCH_SPECULATION_THREAD=1) and without, alternating,
#           ROUNDS rounds (default 2), each planned from the first row (BENCH_PLAN_FROM);
#           then each arm's rows (pin_rows.py) and each trace's compute-stream gaps over
#           0.3 ms (copy_lag.py; specthr.txt). W2 with BENCH_STEPS=20 ~9 min; W3 ~6 min
#   yieldab W3 ours_io_spec1_stream with speculative steps on their own thread
#           (BENCH_SPECULATION_THREAD=1; session 41: the hook mode's step() waited for the
#           speculative steps in flight, 12-19 ms of compute idle), planned and run once
#           beside full GPU by fp32 masters (the floor); then that plan (BENCH_PLAN_FROM)
#           as is and with the ring yielding to the h2d stream (BENCH_RING_YIELD=1: the
#           forward's first prefetch ran 22 ms after its issue, behind ring chunks issued
#           after it), alternating, ROUNDS rounds (default 3); then each arm's rows and
#           each trace's compute gaps (yieldab.txt)                          ~1.2 min a row
#   planthr W3 ours_io_spec1_stream with speculative steps on their own thread (the
#           default from session 41 on), planned for that thread (the default) and for
#           the hooks' way (BENCH_PLAN_SPECULATION_THREAD=0), each row planning anew,
#           alternating, ROUNDS rounds (default 3; the first beside full GPU by fp32
#           masters, for the floor): session 41's replays plan 3 streamed regions for the
#           thread where the hooks' model chose 2; then each arm's rows (planthr.txt)
#                                                                            ~1.2 min a row
#   pubab   each of PUBAB_WORKLOADS (default "W4 W2"; W4 with bf16 moments and torchao
#           beside its first row, W2 with 20 timed steps and FSDP2 likewise) planned and
#           run once with the issuing thread publishing streamed regions as they land (the
#           default from session 42 on), then on that plan (BENCH_PLAN_FROM) without it
#           (BENCH_ISSUER_PUBLISHES=0) and with it, alternating, ROUNDS rounds (default 1);
#           then each arm's rows (pin_rows.py) and each profiled trace's publishes
#           (copy_lag.py --publishes; pubab.txt). W4 ~7.5 min, W2 ~4 min, W3 ~4 min
#   stageab each of STAGEAB_WORKLOADS (default "W3 W2"; W3 with full GPU by fp32 masters
#           beside its first row, for the floor; W2 with 20 timed steps and FSDP2 likewise)
#           planned and run once with the streamed regions' leading chunks staged before
#           step()'s answer (BENCH_STAGE_AHEAD=1; session 43's W3 trace: the first copy
#           up ran 10 ms after step() began, and the next forward idled 24 ms for the two
#           streamed regions), then on that plan (BENCH_PLAN_FROM) without and with,
#           alternating, ROUNDS rounds (default 2); then each arm's
#           rows (pin_rows.py) and each profiled trace's compute-stream gaps (stageab.txt).
#           W3 ~6 min, W2 ~5 min
#   bstageab as stageab (BSTAGEAB_WORKLOADS, default "W3 W2"; ROUNDS default 2), the
#           streamed regions' leading chunks' master weights and moments staged from the
#           backward's first streamed hook (BENCH_STAGE_IN_BACKWARD=1, the default since
#           session 45, and planned so) against neither kind of staging
#           (BENCH_STAGE_IN_BACKWARD=0, on the same plan); each arm's rows
#           (bstage.txt) and the traces' compute-stream gaps (bstageab.txt). W3 ~6 min,
#           W2 ~5 min
#   marginab W3 planned at the host rate measured (the source row, beside full GPU by fp32
#           masters, for the floor), then from its inputs (BENCH_PLAN_FROM) for a host
#           MARGIN (default 1.15) times slower (BENCH_HOST_MARGIN) and at the rate
#           measured, alternating, ROUNDS rounds (default 2); then each arm's rows
#           (pin_rows.py; margin.txt) and the traces' compute-stream gaps. ~6 min
#   sweep   the phases named in SWEEP (default "s37 w1p") in turn, each into OUT_DIR/PHASE
#           with its log in OUT_DIR/PHASE.log and ROUNDS=1 unless set, each started only
#           when its estimate (sweep_estimate_s) fits before SWEEP_LIMIT seconds (default
#           570) from the call's start and cut there; then targets.md over every row of
#           the sweep (sweep.txt says what ran, what was skipped and the seconds). Every
#           target's rows in two calls: SWEEP="s37 w1p", then SWEEP="w4fsp w2x"
#   bifab   for each of BIF_WORKLOADS (default "W2 W3"): a row at the defaults (beside its
#           target's peer: FSDP2 for W2, full GPU by fp32 masters for W3), then one planned
#           with BENCH_BACKWARD_ISSUE_FACTOR=BIF (default 1: as before session 57; the
#           default factor is 4 since session 56, run at 1 and 4 there), ROUNDS rounds
#           (default 1); then each arm's rows (pin_rows.py; bifab.txt) and the replays of
#           each row (replay_bench.py: the host's span of backward(loss) beside the
#           simulated backward's). Does the default plan predict within 15% and run as
#           fast as one made at BIF?                                         ~8 min
#           BIFAB_CALIB=1 adds a row per round planned again after 2 + 3 steps with the
#           factor its own loop's backward gives (BENCH_CALIBRATE=3
#           BENCH_CALIBRATE_BACKWARD=1; check_backward_issue)          ~2 min a row more
#   ringcal  W2 at the defaults, then planned again with the loop's host rate, and with
#           the ring's loop rate too (BENCH_CALIBRATE_RING)                      ~6 min
#   ringrate the ring's copy rates alone and beside a host Adam step, against plain pinned
#           copies (ring_rate.py): fp32 state, then bf16 moments with fp16 I/O   ~2 min
#   upfrac  plans with streamed copies up at the full H2D rate and at UP_FRACTION
#           (default 0.7; BENCH_STREAM_UP_FRACTION), both with the host charged in full
#           (BENCH_STREAM_HOST_CHARGE=1, the model before session 31), alternating, ROUNDS
#           rounds (default 1): W3 ours_io_spec1_stream, W2 the same with 20 timed
#           steps; then each row's run mean and plan (the two plan apart)       ~5 min
#   chargeab plans made as before session 31 (the streamed copies' host contention charged
#           to the host in full, copies up at the full H2D rate: BENCH_STREAM_HOST_CHARGE=1
#           BENCH_STREAM_UP_FRACTION=1) and with it split (today's default; BENCH_STREAM_HOST_CHARGE
#           ${CHARGE:-0.5}, BENCH_STREAM_UP_FRACTION ${UP_FRACTION:-0.78}), alternating, ROUNDS
#           rounds (default 1), for each of CHARGE_WORKLOADS (default "W4 W3 W2"; W4 with
#           bf16 moments and torchao in the first row's call; W2 with 20 timed steps and
#           FSDP2 likewise), every row after the first planned from its inputs
#           (BENCH_PLAN_FROM); then each row's run mean and plan. W4 ~5.5 min a round, W2
#           ~5 min for two, W3 ~4 min for two
#   s28     W4 bf16 moments streamed beside torchao, W3 ours_io_spec1_stream beside FSDP2
#           and torchao, then W1 ours and full GPU for ROUNDS rounds (default 2, the
#           order swapped each round) and their median ratio: the rows a session
#           that already ran w2s and w4fsp still needs for every target      ~9 min
#   pace    the streamed gpu test, then PIN_WORKLOAD (default W3) as PIN_KIND (default
#           ours_io_spec1_stream; W4: ours_io_bf16m_spec1_stream) planned and run once
#           unpaced, then that plan paced (BENCH_STREAM_PACED=1) and unpaced,
#           alternating, ROUNDS rounds (default 1), and one more paced; then W2 planned
#           unpaced and run paced on that plan, 20 timed steps each (skipped with
#           PACE_W2=0); each row's run mean. ROUNDS=0: W3 once each way       ~5 min
#   hostmem what host memory carries for the host Adam and pinned copies at once
#           (host_step_contention.py, every core; `duplex` copies up and down at once: adam_gbps,
#           copy_gbps, host_memory_gbps), then the w2s phase with 20 timed steps ~4 min
#   rates   hostmem's host_step_contention.py alone (host_memory.json), for a call that
#           runs other phases after it                                     ~35 s
#   attn    fused attention's forward and backward rates at W3's and W4's own attention
#           shapes (attention_rates.py -> attention_rates.json), for compute_fidelity.py
#           and replay_bench.py's --attention-fwd / --attention-bwd            ~1 min
#   calibab each of CALIB_WORKLOADS (default "W4 W3 W2"; W4 with bf16 moments and
#           torchao beside its first row, W2 with 20 timed steps and FSDP2 likewise) planned
#           as by default, then planned again after CALIBRATE (default 3) measured steps
#           with the host rate of its own loop (BENCH_CALIBRATE), alternating, ROUNDS rounds
#           (default 1); then each row's run mean (calibab.txt). W4 ~4.5 min, W3 ~2.5
#           min, W2 ~3 min
#   single  single-pass host Adam kernels (numba, in the device image) against torch's
#           fused step and today's speculative step (single_pass_adam_bench.py)    ~1 min
# Results go to OUT_DIR (default: $OUT, else ./gpu_out): logs and JSON, and each bench
# call's profiler summaries and traces in prof_NAME/ (so rows of one kind keep their own).
# Every phase ends with targets.md: benchmarks/targets.py over the folder's JSON files; and
# where the folder holds host_memory.json (the hostmem phase), host_memory_bound.md.
# BENCH_STEPS sets the timed steps of each bench call (default 10).
# Set BENCH_COMMIT when running from a copy of the tree that is not a git checkout.
set -euo pipefail
phase=${1:?usage: gpu_session.sh sweep|bifab|ringcal|cpuprobe|marginab|bstageab|stageab|pubab|planthr|yieldab|streamsel|mastab|ampab|powerab|scaleab|w3res|geluab|attnab|w1p|w2x|calibab|hostmem|rates|attn|chargeab|ringrate|upfrac|pace|s28|pinab|specthr|tests|testsw1|w1x|w1w3|w2t|trace|w1|w2|w3|w4|diag|diag3|curve|threads|spec|bf16m|fidelity|w4b|w4s|w4m|w4f|w4idle|probe|w4p|split|blend|streamf|stream|streamab|streamw4|w4fs|w4fs2|w4fs3|w4fsp|w2s|s24|polishab|issueab|w4issue|io23|io3|io2|specio|single [OUT_DIR]}
out=${2:-${OUT:-gpu_out}}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
srcs=$(ls -d "$root"/packages/*/src | paste -sd:)
export PYTHONPATH="$srcs${PYTHONPATH:+:$PYTHONPATH}"
# bench WORKLOAD KINDS [TIMEOUT_S] [NAME]: results in $out/NAME.json and NAME.log (NAME
# defaults to the workload).
bench() {
  local name=${4:-$1}
  python3 "$root/benchmarks/offload_bench.py" --workloads "$1" --kinds "$2" --steps "${BENCH_STEPS:-10}" \
    --timeout-s "${3:-240}" --json "$out/$name.json" --append "$out/BENCHMARKS.part.md" \
    --profile-dir "$out/prof_$name" 2>&1 | tee "$out/$name.log" | grep -E '^\[bench\]|^\|' || true
}
# gaps TRACE...: each profiled trace's compute-stream gaps over 0.3 ms (copy_lag.py's
# summary line).
gaps() {
  local t
  for t in "$@"; do
    echo "$t: $(python3 "$root/benchmarks/copy_lag.py" "$t" --gap-ms 0.3 | tail -1)"
  done
}
# long_steps TRACE...: each profiled trace's backward lines and its speculative host steps
# over 30 ms (host_timeline.py --spans).
long_steps() {
  local t
  for t in "$@"; do
    echo "== $t"
    python3 "$root/benchmarks/host_timeline.py" --spans "$t" \
      | awk '/^backward/ {print} / speculative step / && $2 + 0 > 30 {print "   long:", $0}'
  done
}
# target_row WORKLOAD: sets k (our kind), steps, limit (seconds a row may take) and peer
# (",PEER": the peer of the target the workload misses, to run beside its first row; W3's
# is full GPU by fp32 masters, whose forward+backward is its floor).
target_row() {
  k=ours_io_spec1_stream steps=${BENCH_STEPS:-10} limit=150 peer=""
  if [ "$1" = W4 ]; then k=ours_io_bf16m_spec1_stream limit=300 peer=,torchao; fi
  if [ "$1" = W2 ]; then steps=20 peer=,fsdp2; fi
  if [ "$1" = W3 ]; then peer=,full_gpu_master; fi
}
# onplan_ab NAME VAR ROUNDS WORKLOAD...: for each workload, target_row's kind planned and
# run once with VAR=1 beside its peer (WORKLOAD_NAME_on1), then on that plan
# (BENCH_PLAN_FROM) with VAR=0 and VAR=1 alternating, ROUNDS rounds; then each arm's rows
# (pin_rows.py) in NAME.txt.
onplan_ab() {
  local name=$1 var=$2 rounds=$3 w i arm
  shift 3
  for w in "$@"; do
    target_row "$w"
    (export "$var=1" BENCH_STEPS="$steps"; bench "$w" "$k$peer" "$((limit + 100))" "${w}_${name}_on1")
    export BENCH_PLAN_FROM="$out/${w}_${name}_on1.json"
    for i in $(seq 1 "$rounds"); do
      (export "$var=0" BENCH_STEPS="$steps"; bench "$w" "$k" "$limit" "${w}_${name}_off$i")
      (export "$var=1" BENCH_STEPS="$steps"; bench "$w" "$k" "$limit" "${w}_${name}_on$((i + 1))")
    done
    unset BENCH_PLAN_FROM
    for arm in on off; do
      python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" "$out"/"${w}_${name}_$arm"[0-9]*.json
    done 2>&1 | tee -a "$out/$name.txt" || true
  done
}
# sweep_estimate_s PHASE: seconds a phase of a sweep takes with ROUNDS=1 on a slow lease
# (BENCHMARKS.md sessions 54-56, about 1.1x the slowest seen); 300 for one not listed.
sweep_estimate_s() {
  case "$1" in
    tests) echo 570 ;; s37) echo 420 ;; w4fsp) echo 300 ;; w1p) echo 120 ;;
    w2x) echo 190 ;; bifab) echo 480 ;; *) echo 300 ;;
  esac
}
case "$phase" in
  sweep)
    start=$SECONDS
    for p in ${SWEEP:-s37 w1p}; do
      left=$((${SWEEP_LIMIT:-570} - (SECONDS - start)))
      need=$(sweep_estimate_s "$p")
      if ((left < need)); then
        echo "[sweep] $p skipped: $left s left, about $need s needed" | tee -a "$out/sweep.txt"
        continue
      fi
      rc=0
      ROUNDS=${ROUNDS:-1} timeout "$left" bash "$root/benchmarks/gpu_session.sh" "$p" "$out/$p" \
        > "$out/$p.log" 2>&1 || rc=$?
      echo "[sweep] $p: exit $rc at $((SECONDS - start)) s" | tee -a "$out/sweep.txt"
    done
    if compgen -G "$out/*/*.json" > /dev/null; then
      python3 "$root/benchmarks/targets.py" "$out"/*/*.json > "$out/targets.md" 2>&1 || true
    fi ;;
  bifab)
    for w in ${BIF_WORKLOADS:-W2 W3}; do
      target_row "$w"
      for i in $(seq 1 "${ROUNDS:-1}"); do
        BENCH_STEPS=$steps bench "$w" "$k$peer" "$((limit + 100))" "${w}_bifdefault$i"
        BENCH_BACKWARD_ISSUE_FACTOR=${BIF:-1} BENCH_STEPS=$steps \
          bench "$w" "$k" "$((limit + 100))" "${w}_bif$i"
        if [ "${BIFAB_CALIB:-0}" = 1 ]; then
          BENCH_CALIBRATE=3 BENCH_CALIBRATE_BACKWARD=1 BENCH_STEPS=$steps \
            bench "$w" "$k" "$((limit + 100))" "${w}_bifcal$i"
        fi
        peer=""
      done
      # The arms' rows that ran (no calibrated ones without BIFAB_CALIB=1).
      mapfile -t rows < <(ls "$out"/"${w}"_bif{default,,cal}[0-9]*.json 2>/dev/null)
      python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" "${rows[@]}" 2>&1 \
        | tee -a "$out/bifab.txt" || true
      python3 "$root/benchmarks/replay_bench.py" "${rows[@]}" 2>&1 \
        | grep -E '^\| |host span|within' | tee -a "$out/bifab.txt" || true
    done ;;
  ringcal)
    # For each workload: the default plan beside its peer, then planned again after 2 + 3
    # steps with the loop's host rate (BENCH_CALIBRATE) and with the ring's rate too
    # (BENCH_CALIBRATE_RING): whether a plan made at the ring's measured rate predicts
    # within 15% and runs as fast.
    for w in ${CALIB_WORKLOADS:-W2}; do
      target_row "$w"
      for i in $(seq 1 "${ROUNDS:-1}"); do
        BENCH_STEPS=$steps bench "$w" "$k$peer" "$((limit + 100))" "${w}_default$i"
        BENCH_CALIBRATE=3 BENCH_STEPS=$steps bench "$w" "$k" "$((limit + 100))" "${w}_calib$i"
        BENCH_CALIBRATE=3 BENCH_CALIBRATE_RING=1 BENCH_STEPS=$steps \
          bench "$w" "$k" "$((limit + 100))" "${w}_ringcal$i"
      done
      python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" \
        "$out"/"${w}"_{default,calib,ringcal}*.json | tee -a "$out/ringcal.txt"
    done ;;
  calibab)
    for w in ${CALIB_WORKLOADS:-W4 W3 W2}; do
      target_row "$w"
      for i in $(seq 1 "${ROUNDS:-1}"); do
        BENCH_STEPS=$steps bench "$w" "$k$peer" "$limit" "${w}_default$i"
        peer=""
        BENCH_CALIBRATE=${CALIBRATE:-3} BENCH_STEPS=$steps \
          bench "$w" "$k" "$((limit + 100))" "${w}_calib$i"
      done
      python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" "$out"/"${w}"_{default,calib}*.json \
        | tee -a "$out/calibab.txt"
    done ;;
  w1w3)
    for i in 1 2; do bench W1 ours,full_gpu 120 W1_$i; done
    bench W3 ours_io_spec1_stream,fsdp2,torchao 150 W3 ;;
  w1x)
    for i in $(seq 1 "${ROUNDS:-4}"); do
      if ((i % 2)); then kinds=ours,full_gpu_master; else kinds=full_gpu_master,ours; fi
      bench W1 "$kinds" 120 "W1_$i"
    done
    python3 "$root/benchmarks/pair_ratios.py" W1 ours full_gpu_master "$out"/W1_*.json | tee "$out/w1_ratios.txt"
    for d in "$out"/prof_W1_*; do
      python3 "$root/benchmarks/issue_compare.py" "$d/trace_W1_ours.json.gz" \
        "$d/trace_W1_full_gpu_master.json.gz" | tee -a "$out/w1_issue.txt" || true
    done ;;
  attnab)
    for i in $(seq 1 "${ROUNDS:-2}"); do
      bench W3 ours_io_spec1_stream 150 "W3_default$i"
      BENCH_MEASURE_ATTENTION=1 bench W3 ours_io_spec1_stream 150 "W3_attn$i"
      BENCH_MEASURE_ATTENTION=1 BENCH_ISSUE_AHEAD=1 bench W3 ours_io_spec1_stream 150 "W3_ahead$i"
    done
    for arm in default attn ahead; do
      python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_"$arm"[0-9]*.json
    done | tee "$out/attnab.txt" ;;
  rateab)
    peer=,full_gpu_master
    for i in $(seq 1 "${ROUNDS:-2}"); do
      BENCH_HOST_RATE=blend bench W3 "ours_io_spec1_stream$peer" 200 "W3_blend$i"
      BENCH_HOST_RATE=samples bench W3 ours_io_spec1_stream 150 "W3_samples$i"
      peer=""
    done
    if [ -n "${RATEAB_W4:-}" ]; then
      BENCH_HOST_RATE=blend bench W4 ours_io_spec1_stream 240 W4_blend1
      BENCH_HOST_RATE=samples bench W4 ours_io_spec1_stream 240 W4_samples1
    fi
    { for arm in blend samples; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_"$arm"[0-9]*.json
        if [ -n "${RATEAB_W4:-}" ]; then
          python3 "$root/benchmarks/pin_rows.py" --all W4 ours_io_spec1_stream "$out"/W4_"$arm"1.json
        fi
      done
    } | tee "$out/rateab.txt" ;;
  streamcap)
    k=ours_io_spec1_stream
    bench W3 "$k,full_gpu_master" 200 W3_cap_source
    export BENCH_PLAN_FROM="$out/W3_cap_source.json"
    arms="${STREAMCAP_MAX:-2 1} all"
    for i in $(seq 1 "${ROUNDS:-2}"); do
      for arm in $arms; do
        if [ "$arm" = all ]; then
          bench W3 "$k" 150 "W3_capall_$i"
        else
          BENCH_STREAM_MAX=$arm bench W3 "$k" 150 "W3_cap${arm}_$i"
        fi
      done
    done
    unset BENCH_PLAN_FROM
    { for arm in $arms; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 "$k" "$out"/W3_cap"${arm}"_[0-9]*.json
        gaps "$out"/prof_W3_cap"${arm}"_*/trace_W3_"$k".json.gz
      done
    } 2>&1 | tee "$out/streamcap.txt" || true ;;
  lateab)
    onplan_ab late BENCH_LATE_HOST_WORK "${ROUNDS:-1}" W3
    gaps "$out"/prof_W3_late_*/trace_*.json.gz 2>&1 | tee -a "$out/late.txt" || true ;;
  claimab)
    onplan_ab claim OFFLOAD_HOST_ADAM_CLAIM_BLOCKS "${ROUNDS:-1}" ${CLAIM_WORKLOADS:-W2 W3}
    long_steps "$out"/prof_W*_claim_*/trace_*ours*.json.gz 2>&1 | tee -a "$out/claim.txt" || true ;;
  cpuprobe)
    for w in ${CPUPROBE_WORKLOADS:-W3 W2}; do
      target_row "$w"
      OFFLOAD_HOST_ADAM_CPU_PROBE=1 BENCH_STEPS=$steps bench "$w" "$k$peer" "$((limit + 100))" "${w}_probe"
      python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" "$out/${w}_probe.json" 2>&1 \
        | tee -a "$out/cpuprobe.txt" || true
      long_steps "$out"/prof_"${w}"_probe/trace_*ours*.json.gz 2>&1 | tee -a "$out/cpuprobe.txt" || true
    done ;;
  slotab)
    # The first row sets the plan's inputs (BENCH_PLAN_FROM) for every arm after it, so
    # that the arms differ in the ring alone: in session 50's call 7, planned each on its
    # own, the 3-slot row streamed two regions and the 6-slot row three.
    bench W3 ours_io_spec1_stream,full_gpu_master 200 W3_slots3_1
    export BENCH_PLAN_FROM="$out/W3_slots3_1.json"
    for i in $(seq 1 "${ROUNDS:-2}"); do
      BENCH_STREAM_SLOTS=${SLOTAB_SLOTS:-6} bench W3 ours_io_spec1_stream 150 "W3_slotsn_$i"
      if [ "$i" -gt 1 ]; then bench W3 ours_io_spec1_stream 150 "W3_slots3_$i"; fi
    done
    unset BENCH_PLAN_FROM
    { for arm in slots3 slotsn; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_"$arm"_[0-9]*.json
        gaps "$out"/prof_W3_"$arm"_*/trace_W3_ours_io_spec1_stream.json.gz
      done
    } 2>&1 | tee "$out/slotab.txt" || true ;;
  geluab)
    for i in $(seq 1 "${ROUNDS:-1}"); do
      BENCH_FUSE_GELU=0 BENCH_PAIR_FULL_GPU=1 BENCH_STEPS=${BENCH_STEPS:-30} bench W1 ours,full_gpu 150 "W1_plain$i"
      BENCH_FUSE_GELU=1 BENCH_PAIR_FULL_GPU=1 BENCH_STEPS=${BENCH_STEPS:-30} bench W1 ours,full_gpu 150 "W1_gelu$i"
      BENCH_FUSE_GELU=0 bench W3 ours_io_spec1_stream 150 "W3_plain$i"
      BENCH_FUSE_GELU=1 bench W3 ours_io_spec1_stream 150 "W3_gelu$i"
    done
    for v in plain gelu; do
      python3 "$root/benchmarks/pair_ratios.py" W1 ours full_gpu "$out"/W1_$v*.json
    done | tee "$out/w1_ratios.txt"
    python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_{plain,gelu}*.json \
      | tee "$out/geluab.txt" ;;
  w1p)
    for i in $(seq 1 "${ROUNDS:-2}"); do
      BENCH_PAIR_FULL_GPU=1 BENCH_STEPS=${BENCH_STEPS:-60} bench W1 "ours,${W1P_PEER:-full_gpu_master}" 150 "W1_$i"
    done
    python3 "$root/benchmarks/pair_ratios.py" W1 ours "${W1P_PEER:-full_gpu_master}" "$out"/W1_*.json \
      | tee "$out/w1_ratios.txt" ;;
  w2x)
    for i in $(seq 1 "${ROUNDS:-2}"); do
      if ((i % 2)); then kinds=fsdp2,ours_io_spec1_stream; else kinds=ours_io_spec1_stream,fsdp2; fi
      BENCH_STEPS=20 bench W2 "$kinds" 150 "W2_$i"
    done
    python3 "$root/benchmarks/pair_ratios.py" W2 ours_io_spec1_stream fsdp2 "$out"/W2_[0-9]*.json \
      | tee "$out/w2_ratios.txt" ;;
  w2t)
    BENCH_STEPS=20 bench W2 fsdp2 120 W2_fsdp2
    for i in 1 2; do
      BENCH_STEPS=20 bench W2 ours_io_spec1_stream 120 W2_thread$i
      BENCH_ISSUE_THREAD=0 BENCH_STEPS=20 bench W2 ours_io_spec1_stream 120 W2_worker$i
    done
    bench W1 ours,full_gpu 120 W1 ;;
  testsw1)
    bash "$0" tests "$out"
    bench W1 ours,full_gpu 120 ;;
  tests) python3 -m nox -s gpu_tests -- -q -s -rA -p no:cacheprovider --durations=15 2>&1 | tee "$out/gpu_tests.log" | tail -40 ;;
  testsq) python3 -m nox -s gpu_tests -- -q -s -rA -p no:cacheprovider --durations=10 \
      -k "not host_step_hides and not async_plan_is_faster and not run_sh_defaults" 2>&1 | tee "$out/gpu_tests_quick.log" | tail -40 ;;
  trace)
    python3 -m pytest -q -s -rA -p no:cacheprovider -m gpu "$root/packages/offload-trace/tests" \
      2>&1 | tee "$out/trace_gpu_tests.log" | tail -30 ;;
  w1) bench W1 ours,full_gpu_master,ablation,fsdp2,torchao 120 ;;
  w2) bench W2 ours,ours_spec,ours_bf16,full_gpu_master,fsdp2,torchao 120 ;;
  w3) bench W3 ours,ours_spec,ours_bf16,full_gpu_master,fsdp2,torchao 150 ;;
  w4) bench W4 ours,ours_bf16m,ours_bf16,torchao 280 ;;
  diag)
    python3 "$root/benchmarks/step_trace.py" --model gpt2_xl --batch 64 --seq 8 \
      --budget-gib 3 --solvers asyn --memory-snapshot --steps 3 --out "$out/step_trace" \
      2>&1 | tee "$out/step_trace.log" | tail -60 ;;
  diag3)
    python3 "$root/benchmarks/step_trace.py" --model gpt2_xl --batch 8 --seq 1024 \
      --budget-gib 40 --solvers asyn --steps 3 --out "$out/step_trace_w3" \
      2>&1 | tee "$out/step_trace_w3.log" | tail -60 ;;
  curve)
    python3 "$root/benchmarks/moments_curve.py" --model gpt2_medium --steps 200 --batch 16 \
      --seq 128 --lr 3e-4 --json "$out/moments_curve.json" 2>&1 | tee "$out/moments_curve.log" \
      | tail -25 ;;
  rates)
    cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")
    python3 "$root/benchmarks/host_step_contention.py" --params 1.4e9 --region 48e6 \
      --threads "$cores" --json "$out/host_memory.json" 2>&1 | tee "$out/host_memory.log" | tail -6 ;;
  attn)
    python3 "$root/benchmarks/attention_rates.py" --workloads W3,W4 \
      --json "$out/attention_rates.json" 2>&1 | tee "$out/attention_rates.log" ;;
  hostmem)
    bash "$0" rates "$out"
    BENCH_STEPS=${BENCH_STEPS:-20} bash "$0" w2s "$out" ;;
  threads)
    python3 "$root/benchmarks/host_step_contention.py" --params 1.4e9 --region 48e6 \
      --json "$out/host_step_contention.json" 2>&1 | tee "$out/host_step_contention.log" | tail -12
    cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")
    bench W3 ours 110 W3_threads_all
    BENCH_HOST_THREADS=$((cores - 1)) bench W3 ours 110 W3_threads_less_one ;;
  spec)
    bench W3 ours,ours_spec,ours_spec1 90 W3_spec
    bench W2 ours,ours_spec,ours_spec1 80 W2_spec ;;
  bf16m)
    bench W3 ours_bf16m,ours_bf16m1 90 W3_bf16m
    bench W4 ours_bf16m1 200 W4_bf16m1 ;;
  fidelity)
    if [ -z "${SKIP_HARDWARE_TEST:-}" ]; then
      python3 -m pytest -q -p no:cacheprovider -m gpu -rA \
        "$root/packages/offload-runtime/tests/test_hardware.py" 2>&1 | tee "$out/hardware_test.log" | tail -30
    fi
    bench W3 ours,ours_spec1,fsdp2,torchao 100 W3_fidelity
    bench W2 ours,ours_spec1,fsdp2,torchao 90 W2_fidelity ;;
  w4b)
    bench W4 ours,ours_bf16m1,torchao 200 W4_b ;;
  w4s)
    bench W4 ours_io,ours_io_spec1,torchao 230 W4_s ;;
  w4m)
    bench W4 ours_io_bf16m,ours_io_bf16m_spec1,ours_io,torchao 200 W4_m ;;
  w4f)
    bench W4 ours_io,ours_io_bf16m,fsdp2,torchao 200 W4_f ;;
  single)
    python3 "$root/benchmarks/single_pass_adam_bench.py" --numel 256e6 --repeats 5 \
      --json "$out/single_pass_adam.json" 2>&1 | tee "$out/single_pass_adam.log" | tail -8 ;;
  io3)
    [ -n "${SKIP_SINGLE:-}" ] || bash "$0" single "$out"
    bench W3 ours,ours_spec1,ours_io,ours_io_spec1,fsdp2,torchao 100 W3_io ;;
  specio)
    bench W3 ours,ours_spec1,ours_io,ours_io_spec1 100 W3_specio
    bench W2 ours,ours_spec1,ours_io,ours_io_spec1 90 W2_specio ;;
  w4idle)
    cores=$(python3 -c "import os; print(len(os.sched_getaffinity(0)))")
    bench W4 ours_io_bf16m_spec1 200 W4_idle_all_cores
    BENCH_HOST_THREADS=$((cores - 1)) bench W4 ours_io_bf16m_spec1,torchao 200 W4_idle_less_one ;;
  profreads)
    python3 "$root/benchmarks/profile_reads.py" --json "$out/profile_reads.json" \
      2>&1 | tee "$out/profile_reads.log" | tail -8 ;;
  probe)
    python3 "$root/benchmarks/host_probe_stability.py" --json "$out/host_probe_stability.json" \
      2>&1 | tee "$out/host_probe_stability.log" | tail -12 ;;
  w4p)
    bash "$0" probe "$out"
    bench W4 ours_io_bf16m_spec1,torchao 200 W4_p ;;
  split)
    python3 "$root/benchmarks/split_step_bench.py" --kernel io_bf16 --params 1.4e9 --chunk 66e6 \
      --fractions 0,0.2,0.3,0.4,0.5 --repeats 3 --json "$out/split_io_bf16.json" \
      2>&1 | tee "$out/split_io_bf16.log" | tail -12
    python3 "$root/benchmarks/split_step_bench.py" --params 1.4e9 --chunk 66e6 \
      --fractions 0,0.3,0.5 --repeats 3 --json "$out/split_fused.json" \
      2>&1 | tee "$out/split_fused.log" | tail -8 ;;
  blend)
    bench W4 ours_io_bf16m_spec1,torchao 200 W4_blend
    bench W3 ours_io,ours_io_spec1 90 W3_blend
    bench W2 ours_io,ours_io_spec1 90 W2_blend ;;
  streamf)
    python3 -m nox -s gpu_tests -- -q -rA -p no:cacheprovider -k streamed 2>&1 \
      | tee "$out/gpu_test_streamed.log" | tail -5
    BENCH_STREAM_FRACTION=${BENCH_STREAM_FRACTION:-0.5} python3 "$root/benchmarks/offload_bench.py" \
      --workloads W4 --kinds ours_io_bf16m_spec1_stream --steps 10 --timeout-s 260 \
      --json "$out/W4_streamf.json" --append "$out/BENCHMARKS.part.md" 2>&1 \
      | tee "$out/W4_streamf.log" | grep -E '^\[bench\]|^\|' || true ;;
  w4fs)
    bench W4 ours_io,ours_io_stream,fsdp2 240 W4_fs ;;
  w4fs2)
    bench W4 ours_io_stream,fsdp2,torchao,ours_io_bf16m_spec1_stream 250 W4_fs2 ;;
  w4fs3)
    bench W4 ours_io_stream,fsdp2 250 W4_fs3 ;;
  s37)
    bench W3 ours_io_spec1_stream,full_gpu_master,fsdp2,torchao 150 W3
    bench W4 ours_io_bf16m_spec1_stream,torchao 280 W4_m ;;
  w4fsp)
    bench W4 ours_io_spec1_stream,fsdp2 300 W4_fsp ;;
  streamab)
    peer=,full_gpu_master
    for i in $(seq 1 "${ROUNDS:-2}"); do
      bench W3 "ours_io_spec1_stream$peer" 200 "W3_stream$i"
      bench W3 ours_io_spec1 150 "W3_nostream$i"
      peer=""
    done
    { python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_stream[0-9]*.json
      python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1 "$out"/W3_nostream[0-9]*.json
    } | tee "$out/streamab.txt" ;;
  streamsel)
    peer=,full_gpu_master
    for i in $(seq 1 "${ROUNDS:-2}"); do
      bench W3 "ours_io_spec1_stream$peer" 200 "W3_plan$i"
      BENCH_STREAM_NOT_FIRST=1 bench W3 ours_io_spec1_stream 150 "W3_notfirst$i"
      bench W3 ours_io_spec1 150 "W3_nostream$i"
      peer=""
    done
    { for arm in plan notfirst; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_"$arm"[0-9]*.json
      done
      python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1 "$out"/W3_nostream[0-9]*.json
      gaps "$out"/prof_W3_*/trace_W3_ours_io_spec1*.json.gz
    } 2>&1 | tee "$out/streamsel.txt" || true ;;
  writeab)
    peer=,full_gpu_master
    for i in $(seq 1 "${ROUNDS:-1}"); do
      BENCH_STREAM_WRITE=0 bench W3 ours_io_spec1_stream 150 "W3_upload$i"
      bench W3 "ours_io_spec1_stream$peer" 200 "W3_write$i"
      BENCH_RING_YIELD=1 bench W3 ours_io_spec1_stream 150 "W3_yield$i"
      peer=""
    done
    { for arm in upload write yield; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 ours_io_spec1_stream "$out"/W3_"$arm"[0-9]*.json
      done
    } | tee "$out/writeab.txt" ;;
  w3res)
    BENCH_BUDGET_GIB=${RES_BUDGET_GIB:-120} bench W3 ours_io_spec1_stream,full_gpu_master 200 W3_res
    d="$out/prof_W3_res"
    { python3 "$root/benchmarks/issue_compare.py" --kernels \
        "$d/trace_W3_ours_io_spec1_stream.json.gz" "$d/trace_W3_full_gpu_master.json.gz"
      python3 "$root/benchmarks/kernel_overlap.py" "$d/trace_W3_ours_io_spec1_stream.json.gz" \
        --against "$d/trace_W3_full_gpu_master.json.gz"
    } 2>&1 | tee "$out/w3res.txt" || true ;;
  scaleab)
    BENCH_FULL_GPU_SCALER=0 bench W3 full_gpu 120 W3_unscaled
    bench W3 ours_io_spec1_stream,full_gpu 200 W3_scaled
    python3 "$root/benchmarks/clock_rows.py" "$out"/W3_unscaled.json "$out"/W3_scaled.json \
      | tee "$out/scaleab.txt" ;;
  powerab)
    BENCH_BUDGET_GIB=${RES_BUDGET_GIB:-120} bench W3 ours_io_spec1_stream,full_gpu 200 W3_res32
    BENCH_BUDGET_GIB=${RES_BUDGET_GIB:-120} bench W3 ours_io_bf16m_spec1_stream,full_gpu_amp 200 W3_res16
    python3 "$root/benchmarks/clock_rows.py" "$out"/W3_res32.json "$out"/W3_res16.json \
      | tee "$out/powerab.txt" ;;
  mastab)
    bench W1 ours,full_gpu_master,full_gpu_amp 150 W1_mast
    bench W3 ours_io_spec1_stream,full_gpu_master 200 W3_mast
    BENCH_BUDGET_GIB=${RES_BUDGET_GIB:-120} bench W3 ours_io_spec1_stream,full_gpu_master 200 W3_mastres
    d="$out/prof_W3_mastres"
    { python3 "$root/benchmarks/clock_rows.py" "$out"/W1_mast.json "$out"/W3_mast.json "$out"/W3_mastres.json
      for peer in full_gpu_master full_gpu_amp; do
        python3 "$root/benchmarks/pair_ratios.py" W1 ours "$peer" "$out"/W1_mast.json
      done
      python3 "$root/benchmarks/issue_compare.py" --kernels \
        "$d/trace_W3_ours_io_spec1_stream.json.gz" "$d/trace_W3_full_gpu_master.json.gz"
      python3 "$root/benchmarks/kernel_overlap.py" "$d/trace_W3_ours_io_spec1_stream.json.gz" \
        --against "$d/trace_W3_full_gpu_master.json.gz"
    } 2>&1 | tee "$out/mastab.txt" || true ;;
  ampab)
    for i in $(seq 1 "${ROUNDS:-1}"); do
      bench W1 ours,full_gpu,full_gpu_amp 150 "W1_amp$i"
      bench W3 ours_io_spec1_stream,full_gpu,full_gpu_amp 240 "W3_amp$i"
    done
    { python3 "$root/benchmarks/clock_rows.py" "$out"/W1_amp[0-9]*.json "$out"/W3_amp[0-9]*.json
      for peer in full_gpu full_gpu_amp; do
        python3 "$root/benchmarks/pair_ratios.py" W1 ours "$peer" "$out"/W1_amp[0-9]*.json
        python3 "$root/benchmarks/pair_ratios.py" W3 ours_io_spec1_stream "$peer" "$out"/W3_amp[0-9]*.json
      done
    } | tee "$out/ampab.txt" ;;
  write2)
    for w in ${WRITE2_WORKLOADS:-W3 W4}; do
      if [ "$w" = W3 ]; then n=2 limit=150; else n=1 limit=240; fi
      BENCH_STREAM_WRITE=0 bench "$w" ours_io_spec1_stream "$limit" "${w}_upload$n"
      bench "$w" ours_io_spec1_stream "$limit" "${w}_write$n"
      for arm in upload write; do
        python3 "$root/benchmarks/pin_rows.py" --all "$w" ours_io_spec1_stream "$out"/"${w}_$arm"[0-9]*.json
      done | tee -a "$out/write2.txt"
    done ;;
  w4gelu)
    BENCH_FUSE_GELU=0 bench W4 ours_io_spec1_stream 300 W4_plain
    bench W4 ours_io_spec1_stream 300 W4_gelu ;;
  s24)
    BENCH_POLISH_ROUNDS=8 bench W3 ours_io_spec1_stream,full_gpu,fsdp2,torchao 150 W3_s24
    BENCH_POLISH_ROUNDS=0 bench W3 ours_io_spec1_stream 150 W3_greedy
    BENCH_POLISH_ROUNDS=8 bench W2 ours_io_spec1_stream,fsdp2,torchao 120 W2_s24
    bench W1 ours,full_gpu 120 W1_s24 ;;
  ringrate)
    python3 "$root/benchmarks/ring_rate.py" --json "$out/ring_rate_fp32.json" 2>&1 | tee "$out/ring_rate.log"
    python3 "$root/benchmarks/ring_rate.py" --moments bf16 --fp16-io \
      --json "$out/ring_rate_bf16_io.json" 2>&1 | tee -a "$out/ring_rate.log" ;;
  chargeab)
    for w in ${CHARGE_WORKLOADS:-W4 W3 W2}; do
      target_row "$w"
      # Every row after the first plans from the first row's inputs (host rate, device
      # memory in use), so the two ways differ only in the split.
      BENCH_STREAM_HOST_CHARGE=1 BENCH_STREAM_UP_FRACTION=1 BENCH_STEPS=$steps \
        bench "$w" "$k$peer" "$limit" "${w}_chargefull1"
      for i in $(seq 1 "${ROUNDS:-1}"); do
        if [ "$i" -gt 1 ]; then
          BENCH_PLAN_FROM="$out/${w}_chargefull1.json" BENCH_STEPS=$steps \
            BENCH_STREAM_HOST_CHARGE=1 BENCH_STREAM_UP_FRACTION=1 \
            bench "$w" "$k" "$limit" "${w}_chargefull$i"
        fi
        BENCH_PLAN_FROM="$out/${w}_chargefull1.json" BENCH_STEPS=$steps \
          BENCH_STREAM_HOST_CHARGE=${CHARGE:-0.5} BENCH_STREAM_UP_FRACTION=${UP_FRACTION:-0.78} \
          bench "$w" "$k" "$limit" "${w}_chargesplit$i"
      done
      python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" "$out"/"${w}"_charge[fs]*.json \
        | tee -a "$out/chargeab.txt"
    done ;;
  upfrac)
    k=ours_io_spec1_stream
    for i in $(seq 1 "${ROUNDS:-1}"); do
      export BENCH_STREAM_HOST_CHARGE=1
      BENCH_STREAM_UP_FRACTION=1 bench W3 "$k" 150 "W3_upfull$i"
      BENCH_STREAM_UP_FRACTION=${UP_FRACTION:-0.7} bench W3 "$k" 150 "W3_upfrac$i"
      BENCH_STEPS=20 BENCH_STREAM_UP_FRACTION=1 bench W2 "$k" 150 "W2_upfull$i"
      BENCH_STEPS=20 BENCH_STREAM_UP_FRACTION=${UP_FRACTION:-0.7} bench W2 "$k" 150 "W2_upfrac$i"
    done
    for w in W3 W2; do
      python3 "$root/benchmarks/pin_rows.py" "$w" "$k" "$out"/"${w}"_up*.json | tee -a "$out/upfrac.txt"
    done ;;
  pace)
    python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
      "$root/packages/offload-optim/tests/test_gpu.py" -k streamed_regions_step_on_the_device \
      2>&1 | tee "$out/pace_gpu_test.log" | tail -3
    w=${PIN_WORKLOAD:-W3}
    k=${PIN_KIND:-ours_io_spec1_stream}
    BENCH_STREAM_PACED=0 bench "$w" "$k" 280 "${w}_pace_source"
    for i in $(seq 1 "${ROUNDS:-1}"); do
      BENCH_PLAN_FROM="$out/${w}_pace_source.json" BENCH_STREAM_PACED=1 bench "$w" "$k" 280 "${w}_pace_on$i"
      BENCH_PLAN_FROM="$out/${w}_pace_source.json" BENCH_STREAM_PACED=0 bench "$w" "$k" 280 "${w}_pace_off$i"
    done
    BENCH_PLAN_FROM="$out/${w}_pace_source.json" BENCH_STREAM_PACED=1 bench "$w" "$k" 280 "${w}_pace_on$((${ROUNDS:-1} + 1))"
    python3 "$root/benchmarks/pin_rows.py" "$w" "$k" "$out"/"${w}"_pace_*.json | tee "$out/${w}_pace.txt"
    if [[ ${PACE_W2:-1} != 0 ]]; then
      k=ours_io_spec1_stream
      BENCH_STEPS=20 BENCH_STREAM_PACED=0 bench W2 "$k" 150 W2_pace_source
      BENCH_STEPS=20 BENCH_PLAN_FROM="$out/W2_pace_source.json" BENCH_STREAM_PACED=1 \
        bench W2 "$k" 150 W2_pace_on1
      python3 "$root/benchmarks/pin_rows.py" W2 "$k" "$out"/W2_pace_*.json | tee "$out/W2_pace.txt"
    fi ;;
  s28)
    bench W4 ours_io_bf16m_spec1_stream,torchao 280 W4_m
    bench W3 ours_io_spec1_stream,fsdp2,torchao 150 W3
    ROUNDS=${ROUNDS:-2} bash "$0" w1x "$out" ;;
  w4issue)
    BENCH_ISSUE_THREAD=0 bench W4 ours_io_bf16m_spec1_stream,torchao 300 W4_worker
    BENCH_ISSUE_THREAD=1 bench W4 ours_io_bf16m_spec1_stream 300 W4_thread ;;
  issueab)
    bench W2 fsdp2 120 W2_fsdp2
    for i in 1 2; do
      BENCH_ISSUE_THREAD=0 bench W2 ours_io_spec1_stream 120 W2_worker$i
      BENCH_ISSUE_THREAD=1 bench W2 ours_io_spec1_stream 120 W2_thread$i
    done
    BENCH_ISSUE_THREAD=0 bench W3 ours_io_spec1_stream 150 W3_worker
    BENCH_ISSUE_THREAD=1 bench W3 ours_io_spec1_stream 150 W3_thread
    BENCH_ISSUE_THREAD=1 BENCH_HOST_THREADS=15 bench W2 ours_io_spec1_stream 120 W2_thread15 ;;
  polishab)
    for i in 1 2; do
      BENCH_POLISH_ROUNDS=0 bench W3 ours_io_spec1_stream 150 W3_greedy$i
      BENCH_POLISH_ROUNDS=8 bench W3 ours_io_spec1_stream 150 W3_polish$i
    done
    BENCH_POLISH_ROUNDS=0 bench W2 ours_io_spec1_stream 120 W2_greedy
    BENCH_POLISH_ROUNDS=8 bench W2 ours_io_spec1_stream 120 W2_polish ;;
  w2s)
    bench W2 ours_io_spec1_stream,fsdp2,torchao 100 W2_s ;;
  pinab)
    w=${PIN_WORKLOAD:-W2}
    k=${PIN_KIND:-ours_io_spec1_stream}
    other=${OTHER_TREE:?pinab needs OTHER_TREE, a copy of the tree to compare with}
    other=$(cd "$other" && pwd)
    bench "$w" "$k" 150 "${w}_pin_source"
    export BENCH_PLAN_FROM="$out/${w}_pin_source.json"
    for i in $(seq 1 "${ROUNDS:-2}"); do
      PYTHONPATH="$(ls -d "$other"/packages/*/src | paste -sd:)${PYTHONPATH#"$srcs"}" \
        python3 "$other/benchmarks/offload_bench.py" --workloads "$w" --kinds "$k" \
        --steps "${BENCH_STEPS:-10}" --timeout-s 150 --json "$out/${w}_pin_other$i.json" \
        2>&1 | tee "$out/${w}_pin_other$i.log" | grep -E '^\[bench\]|^\|' || true
      bench "$w" "$k" 150 "${w}_pin_here$i"
    done
    unset BENCH_PLAN_FROM
    python3 "$root/benchmarks/pin_rows.py" "$w" "$k" "$out"/"${w}"_pin_*.json | tee "$out/${w}_pinab.txt" ;;
  specthr)
    w=${SPECTHR_WORKLOAD:-W2} k=ours_io_spec1_stream peer=""
    if [ "$w" = W3 ]; then peer=,full_gpu_master; fi
    bench "$w" "$k$peer" 200 "${w}_pin_source"
    export BENCH_PLAN_FROM="$out/${w}_pin_source.json"
    for i in $(seq 1 "${ROUNDS:-2}"); do
      BENCH_SPECULATION_THREAD=1 bench "$w" "$k" 150 "${w}_pin_thread$i"
      BENCH_SPECULATION_THREAD=0 bench "$w" "$k" 150 "${w}_pin_hook$i"
    done
    unset BENCH_PLAN_FROM
    { python3 "$root/benchmarks/pin_rows.py" "$w" "$k" "$out"/"${w}"_pin_*.json
      for arm in thread hook; do
        python3 "$root/benchmarks/pin_rows.py" --all "$w" "$k" "$out"/"${w}_pin_$arm"[0-9]*.json
      done
      gaps "$out"/prof_"${w}"_pin_*/trace_"${w}_$k".json.gz
    } 2>&1 | tee "$out/${w}_specthr.txt" || true ;;
  pubab)
    # shellcheck disable=SC2086  # the workloads are words
    onplan_ab pub BENCH_ISSUER_PUBLISHES "${ROUNDS:-1}" ${PUBAB_WORKLOADS:-W4 W2}
    for t in "$out"/prof_*_pub_*/trace_*.json.gz; do
      echo "$t: $(python3 "$root/benchmarks/copy_lag.py" "$t" --publishes | tail -1)"
    done 2>&1 | tee -a "$out/pubab.txt" || true ;;
  marginab)
    k=ours_io_spec1_stream
    bench W3 "$k,full_gpu_master" 250 W3_margin_off1
    export BENCH_PLAN_FROM="$out/W3_margin_off1.json"
    for i in $(seq 1 "${ROUNDS:-2}"); do
      BENCH_HOST_MARGIN=${MARGIN:-1.15} bench W3 "$k" 150 "W3_margin_on$i"
      bench W3 "$k" 150 "W3_margin_off$((i + 1))"
    done
    unset BENCH_PLAN_FROM
    for arm in on off; do
      python3 "$root/benchmarks/pin_rows.py" --all W3 "$k" "$out"/W3_margin_"$arm"[0-9]*.json
    done 2>&1 | tee "$out/margin.txt" || true
    gaps "$out"/prof_W3_margin_*/trace_*.json.gz 2>&1 | tee -a "$out/margin.txt" || true ;;
  bstageab)
    onplan_ab bstage BENCH_STAGE_IN_BACKWARD "${ROUNDS:-2}" ${BSTAGEAB_WORKLOADS:-W3 W2}
    gaps "$out"/prof_*_bstage_*/trace_*.json.gz 2>&1 | tee -a "$out/bstageab.txt" || true ;;
  stageab)
    # shellcheck disable=SC2086
    onplan_ab stage BENCH_STAGE_AHEAD "${ROUNDS:-2}" ${STAGEAB_WORKLOADS:-W3 W2}
    gaps "$out"/prof_*_stage_*/trace_*.json.gz 2>&1 | tee -a "$out/stageab.txt" || true ;;
  thrab)
    k=ours_io_spec1_stream
    bench W3 "$k,full_gpu_master" 200 W3_thr_source
    export BENCH_PLAN_FROM="$out/W3_thr_source.json"
    arms="${THRAB_THREADS:-8 12} all"
    [ "${THRAB_PASSIVE:-0}" = 1 ] && arms="$arms passive"
    for i in $(seq 1 "${ROUNDS:-1}"); do
      for arm in $arms; do
        case "$arm" in
          all) bench W3 "$k" 150 "W3_thrall_$i" ;;
          passive) OMP_WAIT_POLICY=PASSIVE bench W3 "$k" 150 "W3_thrpassive_$i" ;;
          *) BENCH_HOST_THREADS=$arm bench W3 "$k" 150 "W3_thr${arm}_$i" ;;
        esac
      done
    done
    unset BENCH_PLAN_FROM
    { for arm in $arms; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 "$k" "$out"/W3_thr"${arm}"_[0-9]*.json
        for f in "$out"/W3_thr"${arm}"_[0-9]*.json; do
          g=$(basename "$f" .json)
          python3 "$root/benchmarks/compute_fidelity.py" "$f" \
            "$out/prof_$g/trace_W3_$k.json.gz" | tail -4
          python3 "$root/benchmarks/thread_stalls.py" "$out/prof_$g/trace_W3_$k.json.gz"
        done
      done
    } 2>&1 | tee "$out/thrab.txt" || true ;;
  planthr)
    k=ours_io_spec1_stream peer=,full_gpu_master
    for i in $(seq 1 "${ROUNDS:-3}"); do
      bench W3 "$k$peer" 200 "W3_pthread$i"
      BENCH_PLAN_SPECULATION_THREAD=0 bench W3 "$k" 150 "W3_phook$i"
      peer=""
    done
    { for arm in pthread phook; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 "$k" "$out"/W3_"$arm"[0-9]*.json
      done
    } 2>&1 | tee "$out/planthr.txt" || true ;;
  yieldab)
    k=ours_io_spec1_stream
    export BENCH_SPECULATION_THREAD=1
    bench W3 "$k,full_gpu_master" 200 W3_yab_source
    export BENCH_PLAN_FROM="$out/W3_yab_source.json"
    for i in $(seq 1 "${ROUNDS:-3}"); do
      BENCH_RING_YIELD=1 bench W3 "$k" 150 "W3_yab_yield$i"
      bench W3 "$k" 150 "W3_yab_plain$i"
    done
    unset BENCH_PLAN_FROM BENCH_SPECULATION_THREAD
    { for arm in yield plain; do
        python3 "$root/benchmarks/pin_rows.py" --all W3 "$k" "$out"/W3_yab_"$arm"[0-9]*.json
      done
      gaps "$out"/prof_W3_yab_*/trace_W3_"$k".json.gz
    } 2>&1 | tee "$out/yieldab.txt" || true ;;
  streamw4)
    bench W4 ours_io_bf16m_spec1,ours_io_bf16m_spec1_stream,torchao 260 W4_streamab
    bench W2 ours_io_spec1,ours_io_spec1_stream 100 W2_streamab ;;
  stream)
    bench W4 ours_io_bf16m_spec1_stream,torchao 260 W4_stream
    bench W3 ours_io_spec1_stream 100 W3_stream
    bench W2 ours_io_spec1_stream 100 W2_stream ;;
  io23)
    bench W2 ours_io,ours_io_spec1,fsdp2,torchao 90 W2_io23
    bench W3 ours_io,ours_io_spec1,fsdp2,torchao 100 W3_io23 ;;
  io2)
    bench W2 ours,ours_spec1,ours_io,ours_io_spec1,fsdp2,torchao 90 W2_io ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
# The issue's targets over every row this output folder holds (CPU only, a second).
if compgen -G "$out/*.json" > /dev/null; then
  python3 "$root/benchmarks/targets.py" "$out"/*.json > "$out/targets.md" 2>&1 || true
  # With the hostmem phase's rates in the folder: each row against what host memory carries.
  if [ -f "$out/host_memory.json" ]; then
    python3 "$root/benchmarks/host_memory_bound.py" --rates "$out/host_memory.json" \
      "$out"/*.json > "$out/host_memory_bound.md" 2>&1 || true
  fi
fi
