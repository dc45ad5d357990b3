#!/usr/bin/env bash
# One device call: GPU test suite (sharded over processes so kernels compile in parallel),
# optional tuning, then the benchmark. Logs and JSON go to $OUT (or ./out).
#   bash scripts/gpu_check.sh [tests] [tests_rest] [tests_tail] [feature_tests] [tune] [tune_features] [bench] [memory] [modules] [features] [decode] [overhead] [host] [varlen] [decode_tune] [figures] [product] [ws_persist] [module_kernels] [cute] [cute_bwd] [cute_profile] [cute_order] [dropout] [op] [split] [order] [d96] [d128] [hang256] [ws_causal] [ws_bwd] [ds_gemm]
# cute: the CuTe GPU tests and scripts/bench_cute.py; cute_bwd: the CuTe backward's test and timing; cute_profile:
# ncu on one CuTe backward launch (stall reasons); all three need
# the DSL on the machine (cutedsl-prepare.sh part 1 and 2)
# tests with the DSL installed, SHARDS=8: 450-510 s per shard (fourteenth session; a TEST_TIMEOUT of 540 cut one);
# twentieth session: SHARDS=11 TEST_TIMEOUT=530 ran 90-94 % of each shard in a 600 s call, then `tests_tail` (TAIL=380)
# the rest in a second; twenty-first: one shard stopped at 89 %, one position short of TAIL=380's reach: use TAIL=420
# thirty-first: each shard appends its finished test ids to $OUT/done_<i>.txt (FA_BACKEND_TEST_DONE, tests/conftest.py),
# merged into $OUT/done.txt; copy it alone to .gpu_done/ (older files there count as done too) and `tests_rest` runs
# exactly what the cut shards left (3912 tests: SHARDS=11 TEST_TIMEOUT=540 ran 3471; the rest, by a one-off script of
# the same logic before this step existed, in 167 s; the step itself checked on the CPU only)
# env: PROFILE_ARGS, PROFILE_SCRIPT, PROFILE_TIMEOUT, SHARDS, TAIL, TUNE_DECODE_ARGS, TUNE_FEATURES_ARGS, BENCH_TIMEOUT, CUTE_BENCH_ARGS (e.g. --runners cute_ws_overlap cute_ws_pingpong), CUTE_BWD_ARGS, TEST_TIMEOUT, TUNE_KERNELS, TUNE_DIMS, TUNE_SEQLENS, TUNE_MATCH, TUNE_GROUP, BENCH_ARGS, DECODE_ARGS, TUNE_TIMEOUT, HOST_ARGS (e.g. --profile), PRODUCT_ARGS
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests bench}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader || true
export PYTHONPATH=$PWD
status=0
if [[ " $steps " == *" tests "* ]]; then
  n=${SHARDS:-6}
  for i in $(seq 0 $((n - 1))); do
    # SIGINT at the limit: pytest then prints what passed and failed so far (a SIGTERM left only the dots)
    FA_BACKEND_TEST_DONE="$OUT/done_$i.txt" timeout -s INT -k 30 ${TEST_TIMEOUT:-900} python3 -m pytest tests -q \
      --maxfail=10 -p no:cacheprovider --shard="$i/$n" > "$OUT/tests_$i.log" 2>&1 &
  done
  for i in $(seq 0 $((n - 1))); do wait -n || status=1; done
  for i in $(seq 0 $((n - 1))); do echo "shard $i: $(tail -n 1 "$OUT/tests_$i.log")"; done
  grep -h -E "^(FAILED|ERROR)" "$OUT"/tests_*.log | head -40
  # the failures' assertion lines in the call's output: the device tool brings back a few files only (thirty-first
  # session: tests.log and three done files were left out by count)
  grep -h -E "^E |^seed=" "$OUT"/tests_*.log | grep -B1 "^E " | head -60
  cat "$OUT"/tests_*.log > "$OUT/tests.log"; rm -f "$OUT"/tests_*.log
  cat "$OUT"/done_*.txt > "$OUT/done.txt" 2>/dev/null; rm -f "$OUT"/done_*.txt  # one file: copy it to DONE_DIR
fi
if [[ " $steps " == *" tests_tail "* ]]; then
  # the last TAIL tests of the collection order over pytest-xdist: what shards cut by TEST_TIMEOUT leave (interleaved
  # shards stop at about the same position of the order; twentieth session: SHARDS=11 TEST_TIMEOUT=530 ran 90-94 % of
  # every shard, TAIL=380 the rest)
  python3 -m pytest tests --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::" | tail -n ${TAIL:-420} \
    > "$OUT/tail_ids.txt"
  timeout -s INT -k 30 ${TEST_TIMEOUT:-500} xargs -d '\n' -a "$OUT/tail_ids.txt" python3 -m pytest -q \
    -p no:cacheprovider -n ${SHARDS:-14} > "$OUT/tests_tail.log" 2>&1 || status=1
  tail -n 3 "$OUT/tests_tail.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/tests_tail.log" | head -20
fi
if [[ " $steps " == *" tests_rest "* ]]; then
  # the tests that a cut `tests` call did not reach: every collected id not in DONE_DIR/done*.txt (that call's
  # $OUT/done.txt, copied into the tree; .gpu_done by default, which git ignores: name it in the device call's carry,
  # else nothing counts as done and every test runs; thirty-second session). done = finished, failed ones too: take
  # failures' ids out of the file to run them again. xargs may split the ids over several pytest runs in turn
  python3 -m pytest tests --collect-only -q -p no:cacheprovider 2>/dev/null | grep "::" | sort > "$OUT/all_ids.txt"
  [[ -n "$(ls "${DONE_DIR:-.gpu_done}"/done*.txt 2>/dev/null)" ]] || echo "tests_rest: no ${DONE_DIR:-.gpu_done}/done*.txt (not carried?)"
  cat "${DONE_DIR:-.gpu_done}"/done*.txt 2>/dev/null | sort -u > "$OUT/done_ids.txt"
  comm -23 "$OUT/all_ids.txt" "$OUT/done_ids.txt" > "$OUT/rest_ids.txt"
  echo "tests_rest: $(wc -l < "$OUT/all_ids.txt") collected, $(wc -l < "$OUT/done_ids.txt") done, $(wc -l < "$OUT/rest_ids.txt") to run"
  if [[ -s "$OUT/rest_ids.txt" ]]; then
    timeout -s INT -k 30 ${TEST_TIMEOUT:-500} xargs -d '\n' -a "$OUT/rest_ids.txt" python3 -m pytest -q \
      -p no:cacheprovider -n ${SHARDS:-14} > "$OUT/tests_rest.log" 2>&1 || status=1
    tail -n 3 "$OUT/tests_rest.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/tests_rest.log" | head -20
  fi
fi
if [[ " $steps " == *" feature_tests "* ]]; then
  # the kernels' optional features only (masks, dropout, varlen, KV cache): pytest-xdist over SHARDS processes
  timeout ${TEST_TIMEOUT:-900} python3 -m pytest -q -p no:cacheprovider -n ${SHARDS:-6} \
    tests/kernels/triton/test_flash_features_gpu.py tests/kernels/triton/test_varlen_gpu.py \
    tests/kernels/triton/test_kvcache_gpu.py tests/kernels/triton/test_sdpa_decode.py \
    tests/kernels/triton/test_flash_features.py tests/kernels/triton/test_mask_bounds.py tests/kernels/triton/test_tma_loads.py \
    tests/integrations/test_sdpa_decode_gpu.py tests/integrations/test_routing_gpu.py \
    > "$OUT/feature_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/feature_tests.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/feature_tests.log" | head -20
fi
if [[ " $steps " == *" tune_features "* ]]; then
  timeout ${TUNE_TIMEOUT:-420} python3 scripts/tune_features.py --cases ${TUNE_CASES:-random_keys key_padding dropout} \
    --seqlens ${TUNE_SEQLENS:-8192} ${TUNE_FEATURES_ARGS:-} --json "$OUT/tune_features.json" > "$OUT/tune_features.log" 2>&1 || status=1
  grep -v -i warn "$OUT/tune_features.log" | tail -n 60
fi
if [[ " $steps " == *" tune "* ]]; then
  python3 scripts/tune_triton.py --dims ${TUNE_DIMS:-64 128 256} --seqlens ${TUNE_SEQLENS:-4096} \
    --kernels ${TUNE_KERNELS:-fwd dkdv dq} ${TUNE_MATCH:+--match $TUNE_MATCH} --group ${TUNE_GROUP:-1} --json "$OUT/tune.json" \
    > "$OUT/tune.log" 2>&1 || status=1
  sed -n '/^compiled/p;/FAILED/p;/^best per/,$p' "$OUT/tune.log"
fi
if [[ " $steps " == *" bench "* ]]; then
  extra=""; [[ " $steps " == *" memory "* ]] && extra="--memory --overhead"
  python3 -m fa_backend bench ${BENCH_ARGS:-} $extra --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || status=1
  sed -n '/TFLOP\/s, d=/,$p' "$OUT/bench.log"
fi
if [[ " $steps " == *" features "* ]]; then
  python3 -m fa_backend bench --features --json "$OUT/features.json" > "$OUT/features.log" 2>&1 || status=1
  grep -v -i warn "$OUT/features.log" | tail -n 40
fi
if [[ " $steps " == *" decode "* ]]; then
  for mode in eager graph; do
    flag=""; [[ $mode == graph ]] && flag="--graph"
    python3 -m fa_backend.bench_decode $flag --json "$OUT/decode_$mode.json" ${DECODE_ARGS:-} \
      > "$OUT/decode_$mode.log" 2>&1 || status=1
    grep -v -i -E "warn|return F" "$OUT/decode_$mode.log" | awk 'NR<=2 || $2==1' | head -n 40
  done
fi
if [[ " $steps " == *" varlen "* ]]; then
  for c in "" "--causal"; do
    python3 -m fa_backend.bench_varlen $c --json "$OUT/varlen${c:+_causal}.json" > "$OUT/varlen${c:+_causal}.log" 2>&1 || status=1
    grep -v -i warn "$OUT/varlen${c:+_causal}.log" | tail -n 12
  done
fi
if [[ " $steps " == *" overhead "* ]]; then
  python3 -m fa_backend bench --overhead-only 2>&1 | tail -n 8
fi
if [[ " $steps " == *" decode_tune "* ]]; then
  timeout ${TUNE_TIMEOUT:-420} python3 scripts/tune_decode.py ${TUNE_DECODE_ARGS:-} --json "$OUT/tune_decode.json" > "$OUT/tune_decode.log" 2>&1 || status=1
  grep -v -i warn "$OUT/tune_decode.log" | tail -n 60
fi
if [[ " $steps " == *" host "* ]]; then
  python3 scripts/host_breakdown.py ${HOST_ARGS:-} --json "$OUT/host.json" > "$OUT/host.log" 2>&1 || status=1
  grep -v -i warn "$OUT/host.log" | tail -n 90
fi
if [[ " $steps " == *" modules "* ]]; then
  python3 scripts/bench_modules.py --json "$OUT/modules.json" > "$OUT/modules.log" 2>&1 || status=1
  cat "$OUT/modules.log" | tail -n 40
fi
if [[ " $steps " == *" module_kernels "* ]]; then
  python3 scripts/module_kernels.py > "$OUT/module_kernels.log" 2>&1 || status=1
  grep -v -i warn "$OUT/module_kernels.log" | tail -n 120
fi
if [[ " $steps " == *" figures "* ]]; then
  # issue 6's and issue 4's H200 cells in one call, each step in its own process and time limit: the standard sweep
  # (JSON + PNG), head dims 96 / 192 / 256, GQA hq=32 / hkv=8 against the same shapes without GQA, the tiny call's host
  # time, then masks and dropout (bench --features)
  timeout 220 python3 -m fa_backend bench --out "$OUT/sweep" > "$OUT/sweep.log" 2> "$OUT/sweep.err" || status=1
  sed -n '/TFLOP\/s, d=/,$p' "$OUT/sweep.log" | grep -v "^ *$" | head -n 120
  timeout 120 python3 -m fa_backend bench --backends triton flash cudnn --dims 96 192 256 --seqlens 2048 4096 8192 \
    --json "$OUT/dims.json" > "$OUT/dims.log" 2>&1 || status=1
  sed -n '/TFLOP\/s, d=/,$p' "$OUT/dims.log" | grep -v "^ *$" | head -n 60
  for kv in "" "--kv-heads 8"; do
    timeout 60 python3 -m fa_backend bench --shape 8,32,2048,128 --shape 2,32,8192,128 $kv --backends triton cudnn \
      --json "$OUT/gqa${kv:+_8}.json" 2>&1 | grep -v -i warn | tail -n 12 || status=1
  done
  timeout 60 python3 -m fa_backend bench --overhead-only 2>&1 | tail -n 8
  # FIGURES_FEATURES=0 leaves the features bench to a later call (`features`): the whole step can pass 600 s
  if [[ ${FIGURES_FEATURES:-1} != 0 ]]; then
    timeout 200 python3 -m fa_backend bench --features --json "$OUT/features.json" > "$OUT/features.log" 2>&1 || status=1
    grep -v -i warn "$OUT/features.log" | tail -n 40
  fi
fi
if [[ " $steps " == *" product "* ]]; then
  # the benchmark as a user runs it: --out DIR (JSON + PNG), a progress line, shapes from the command line
  python3 -m fa_backend bench --out "$OUT/product" ${PRODUCT_ARGS:---shape 2,16,2048,128 --shape 8,32,512,64 --flex} \
    > "$OUT/product.log" 2> "$OUT/product.err" || status=1
  cat "$OUT/product.log" | tail -n 30; tail -c 600 "$OUT/product.err"; ls -la "$OUT/product" || true
fi
if [[ " $steps " == *" cute_bwd "* ]]; then
  # the CuTe backward alone: its numerics test, then its timing (a separate process: a fault cannot spoil the rest)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/kernels/cute/test_flash_bwd_gpu.py -q -x -p no:cacheprovider -n ${CUTE_WORKERS:-4} \
    > "$OUT/cute_bwd_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/cute_bwd_tests.log"; grep -h -E "^(FAILED|ERROR|E  )" "$OUT/cute_bwd_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_cute.py --backward ${CUTE_BWD_ARGS:-} --json "$OUT/bench_cute_bwd.json" \
    > "$OUT/bench_cute_bwd.log" 2>&1 || status=1
  grep -v -i warn "$OUT/bench_cute_bwd.log" | tail -n 20
fi
if [[ " $steps " == *" dropout "* ]]; then
  # dropout on the CuTe kernels (saved keep bits: kernels/keep_bits.py): its GPU tests and routing test, then the
  # kernels with and without saved bits (time_keep_bits.py) and the op against cuDNN (bench_dropout.py --backward)
  # DROPOUT_TESTS: a pytest -k expression (all by default); KEEP_BITS_ARGS / DROPOUT_ARGS: the two scripts' arguments
  # (e.g. --periods 1 2 4; --seqlens 16384); DROPOUT_STEPS: which of tests / kernels / op run (all three by default)
  if [[ " ${DROPOUT_STEPS:-tests kernels op} " == *" tests "* ]]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/kernels/cute/test_dropout_gpu.py tests/integrations/test_routing_gpu.py \
    -q -p no:cacheprovider -n ${CUTE_WORKERS:-14} ${DROPOUT_TESTS:+-k "$DROPOUT_TESTS"} > "$OUT/dropout_tests.log" 2>&1 \
    || status=1
  tail -n 3 "$OUT/dropout_tests.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/dropout_tests.log" | head -20
  grep -h -E "^E " "$OUT/dropout_tests.log" | head -30
  fi
  if [[ " ${DROPOUT_STEPS:-tests kernels op} " == *" kernels "* ]]; then
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/time_keep_bits.py ${KEEP_BITS_ARGS:-} --json "$OUT/keep_bits.json" 2>&1 \
    | grep -v -i warn || status=1
  fi
  if [[ " ${DROPOUT_STEPS:-tests kernels op} " == *" op "* ]]; then
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_dropout.py --dims 128 --backward --runners cute cudnn \
    ${DROPOUT_ARGS:-} --json "$OUT/bench_dropout.json" 2>&1 | grep -v -i warn || status=1
  fi
fi
if [[ " $steps " == *" op "* ]]; then
  # the CuTe op and its eager twin (ops/cute_flash.py): the op's GPU tests with dropout and routing, then the op
  # against cuDNN with dropout (bench_dropout.py --backward) and where a 2k training call's time goes
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest tests/ops/test_cute_flash_gpu.py tests/ops/test_cute_head_dim_v_gpu.py \
    tests/kernels/cute/test_dropout_gpu.py tests/integrations/test_routing_gpu.py -q -p no:cacheprovider \
    -n ${CUTE_WORKERS:-14} > "$OUT/op_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/op_tests.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/op_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_dropout.py --dims 128 --backward --runners cute cudnn \
    --json "$OUT/bench_dropout.json" 2>&1 | grep -v -i warn || status=1
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/profile_op_kernels.py --seqlens 2048 --causal yes no \
    > "$OUT/profile_op_kernels.log" 2>&1 || status=1
  grep -E "^s=|host" "$OUT/profile_op_kernels.log"
fi
if [[ " $steps " == *" cute_profile "* ]]; then
  # Nsight Compute on one CuTe backward launch (scripts/profile_cute_bwd.py; PROFILE_ARGS e.g. "--causal --d 64"), or
  # the forward's (PROFILE_SCRIPT=scripts/profile_cute_fwd.py): duration, instructions, shared-memory traffic and the
  # stall reasons per issued instruction
  m="gpu__time_duration.sum,smsp__inst_executed.sum,smsp__average_warp_latency_per_inst_issued.ratio"
  m="$m,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_shared_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
  for r in barrier long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle dispatch_stall selected not_selected; do
    m="$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
  done
  timeout ${PROFILE_TIMEOUT:-120} ncu --kernel-name regex:kernel_cutlass --launch-skip 2 --launch-count 1 --metrics "$m" \
    python3 ${PROFILE_SCRIPT:-scripts/profile_cute_bwd.py} ${PROFILE_ARGS:-} > "$OUT/cute_profile.log" 2>&1 || status=1
  grep -E "duration|inst_executed|latency|bank|stalled" "$OUT/cute_profile.log" | awk '{print $1, $(NF-1), $NF}'
fi
if [[ " $steps " == *" split "* ]]; then
  # the Triton kernels' GPU tests (the packed-sequence file apart: it runs out of GPU memory beside other workers),
  # then the split-column kernels (d = 129-192) timed at their default tiles against the general ones and PyTorch's;
  # SPLIT_TESTS: test files instead of the whole folder; SPLIT_WIDE_ARGS: the 128 + 128 backward at d=256 (the default since the thirty-ninth session) at other pairs, e.g. "--pairs 64,64,8,2/64,64,8,2"
  timeout -s INT -k 20 ${TEST_TIMEOUT:-250} python3 -m pytest ${SPLIT_TESTS:-tests/kernels/triton} -m gpu -q -p no:cacheprovider -n 3 \
    --ignore tests/kernels/triton/test_varlen_gpu.py > "$OUT/triton_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/triton_tests.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/triton_tests.log" | head -20
  # SPLIT_FWD=0 / SPLIT_BWD=0: without the default timings; SPLIT_BWD_ARGS: more time_bwd_split.py arguments
  if [[ "${SPLIT_FWD:-1}" == 1 ]]; then
    timeout 100 python3 scripts/time_fwd_split.py --json "$OUT/fwd_split.json" 2>&1 | grep "^d=" || status=1
  fi
  if [[ "${SPLIT_BWD:-1}" == 1 ]]; then
    timeout 180 python3 scripts/time_bwd_split.py --launches ${SPLIT_BWD_ARGS:-} --json "$OUT/bwd_split.json" 2>&1 \
      | grep -E "^(d=|  launch)" || status=1
  fi
  if [[ -n "${SPLIT_WIDE_ARGS:-}" ]]; then
    timeout ${WIDE_TIMEOUT:-100} python3 scripts/time_bwd_split.py --dims 256 --seqlens 2048 8192 $SPLIT_WIDE_ARGS \
      --json "$OUT/bwd_split_wide.json" 2>&1 | grep "^d=" || status=1
  fi
  # WS_ARGS: the warp-specialized dK / dV kernel at other head dims / tiles, e.g. "--dims 64 --tile 64,128,4,2"
  if [[ -n "${WS_ARGS:-}" ]]; then
    timeout 100 python3 scripts/time_bwd_ws.py --seqlens 2048 8192 $WS_ARGS --json "$OUT/bwd_ws.json" 2>&1 \
      | grep "^d=" || status=1
  fi
  # SPLIT_SMALL=1: the 64 + 32 split at d=96 (the forward's default since the forty-first session; the backward's an
  # experiment, off: sm90 compile, dK / dV 32 x 128 x 8 x 2 no spills, 64 x 64 x 8 x 2 88 bytes), forward and backward
  if [[ -n "${SPLIT_SMALL:-}" ]]; then
    timeout 80 python3 scripts/time_fwd_split.py --dims 96 --seqlens 2048 8192 --tiles 128,64,8,3 128,128,8,2 \
      128,128,8,3 --json "$OUT/fwd_split_small.json" 2>&1 | grep "^d=" || status=1
    timeout 80 python3 scripts/time_bwd_split.py --dims 96 --seqlens 2048 8192 --pairs 64,64,8,2/128,64,8,2 \
      32,128,8,2/128,128,8,2 64,64,8,2/128,128,8,2 --json "$OUT/bwd_split_small.json" 2>&1 | grep "^d=" || status=1
  fi
fi
if [[ " $steps " == *" order "* ]]; then
  # the causal variants of the split kernels (thirty-ninth / fortieth sessions): block-major launches (`_bm`) and one
  # masked dK / dV loop (`_1l`), both the backward's default at 129-192 since the fortieth: their GPU tests, then
  # each kernel timed with and without them in one process
  timeout -s INT -k 20 150 python3 -m pytest tests/kernels/triton/test_flash_bwd_split.py \
    -k "block_major or loops or experiments or defaults" -q -p no:cacheprovider -n 3 \
    > "$OUT/order_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/order_tests.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/order_tests.log" | head -20
  timeout 100 python3 scripts/time_fwd_split.py --causal yes --block-major --seqlens 2048 8192 \
    --json "$OUT/order_fwd_split.json" 2>&1 | grep "^d=" || status=1
  timeout 200 python3 scripts/time_bwd_split.py --dims 192 256 --causal yes --block-major --one-loop \
    --seqlens 2048 8192 \
    --json "$OUT/order_bwd_split.json" 2>&1 | grep "^d=" || status=1
fi
if [[ " $steps " == *" d96 "* ]]; then
  # the forward at d=96 on 64 + 32 columns (flash_fwd_split, the default from 1k keys, causal 2k, since the forty-first
  # session: 128 x 64 x 8 x 3; sm90 compile, causal, 123 registers / 99 KB, 128 x 128 x 8 x 2 173 / 124 KB, no spills)
  # against the general and warp-specialized kernels on 128-wide tiles
  timeout 120 python3 scripts/time_fwd_split.py --dims 96 --causal no yes --seqlens 2048 8192 \
    --tiles 128,64,8,3 128,128,8,2 128,128,8,3 --json "$OUT/fwd_split_d96.json" 2>&1 | grep "^d=" || status=1
fi
if [[ " $steps " == *" d128 "* ]]; then
  # d=128 on two 64-column tiles (backward at d=192's tiles, causal with one loop / block-major; forward causal):
  # prepared in the forty-second session; both lose to the general kernels (H100, forty-third session, perf-log)
  timeout 100 python3 scripts/time_bwd_split.py --dims 128 --causal yes no --seqlens 2048 8192 \
    --pairs 32,128,8,2/128,64,8,2 --block-major --one-loop --json "$OUT/bwd_split_d128.json" 2>&1 | grep "^d=" || status=1
  timeout 80 python3 scripts/time_fwd_split.py --dims 128 --causal yes --extra-class 128:64,64 --block-major \
    --tiles 128,64,8,3 128,128,8,2 --seqlens 2048 8192 --json "$OUT/fwd_split_d128.json" 2>&1 | grep "^d=" || status=1
  # the 512 / 1k forward tiles through the tune step (no gain, forty-third session): TUNE_KERNELS=fwd TUNE_DIMS=128
  # TUNE_SEQLENS="512 1024" TUNE_MATCH=block_m=64 bash scripts/gpu_check.sh d128 tune
fi
if [[ " $steps " == *" ws_persist "* ]]; then
  # the warp-specialized forward's persistent kernel (flash_fwd_ws.PERSISTENT, written in the fifty-third session, on
  # since the fifty-fourth): its GPU tests, then its timing against the per-tile WS kernel, the general kernel, cuDNN
  # and SDPA-flash
  timeout -s INT ${TEST_TIMEOUT:-150} python3 -m pytest tests/kernels/triton/test_flash_fwd_ws.py -m gpu -q \
    -p no:cacheprovider -k "persistent or real_size and not causal" -n ${SHARDS:-8} > "$OUT/ws_persist_tests.log" 2>&1 \
    || status=1
  tail -n 3 "$OUT/ws_persist_tests.log"; grep -h -E "^(FAILED|ERROR)|^E " "$OUT/ws_persist_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-200} python3 scripts/time_fwd_ws.py --dims ${WS_DIMS:-128 96 64} --persistent \
    --seqlens ${WS_SEQLENS:-512 1024 2048 4096 8192 16384} --json "$OUT/ws_persist.json" 2>&1 | grep -v -i warn \
    || status=1
fi
if [[ " $steps " == *" ws_causal "* ]]; then
  # the warp-specialized forward's opt-in causal form (flash_fwd_ws.CAUSAL_ENABLED, written in the forty-fourth
  # session, its O store fixed in the fifty-fifth) and its persistent form (CAUSAL_PERSISTENT): the file's GPU tests (the per-tile ones are marked xfail until they pass: --runxfail runs them as plain tests), then its
  # timing against the general kernel, cuDNN and SDPA-flash (ws_... a program per tile, wsp_... persistent)
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/kernels/triton/test_flash_fwd_ws.py -m gpu -q -p no:cacheprovider \
    --runxfail -n ${SHARDS:-8} > "$OUT/ws_causal_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/ws_causal_tests.log"; grep -h -E "^(FAILED|ERROR)|^E " "$OUT/ws_causal_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-200} python3 scripts/time_fwd_ws.py --dims ${WS_DIMS:-128 64} --causal yes --persistent \
    --seqlens ${WS_SEQLENS:-1024 2048 4096 8192 16384} --json "$OUT/ws_causal.json" 2>&1 | grep -v -i warn || status=1
fi
if [[ " $steps " == *" ws_bwd "* ]]; then
  # the dK / dV kernel's opt-in causal and GQA forms (flash_bwd_ws.CAUSAL_ENABLED, GQA_ENABLED, fifty-fifth session):
  # the file's GPU tests (MHA too), then the timings: causal MHA, then hq = 4 hkv causal or not (another call than
  # ws_causal: both in one pass the 600 s limit)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/kernels/triton/test_flash_bwd_ws.py -m gpu -q -p no:cacheprovider \
    -n ${SHARDS:-8} > "$OUT/ws_bwd_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/ws_bwd_tests.log"; grep -h -E "^(FAILED|ERROR)|^E " "$OUT/ws_bwd_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-200} python3 scripts/time_bwd_ws.py --dims ${WS_DIMS:-128 64} --causal yes \
    --seqlens ${WS_SEQLENS:-1024 2048 4096 8192 16384} --json "$OUT/ws_causal_bwd.json" 2>&1 | grep -v -i warn || status=1
  timeout ${BENCH_TIMEOUT:-150} python3 scripts/time_bwd_ws.py --dims 128 --causal no yes --gqa 4 \
    --seqlens ${WS_GQA_SEQLENS:-2048 8192} --json "$OUT/ws_gqa_bwd.json" 2>&1 | grep -v -i warn || status=1
fi
if [[ " $steps " == *" ds_gemm "* ]]; then
  # the d=193-256 backward's dQ from dS^T in memory (flash_bwd_split.DS_GEMM; forty-fourth session on one buffer,
  # forty-fifth in pieces of DS_GEMM_MAX_BYTES, on by default; forty-sixth dQ by the dq_from_ds kernel): the split
  # backward's GPU tests, then the whole backward in its variants against the dQ launch, cuDNN and SDPA-flash
  # (DSG_DIMS: other head dims, e.g. 192)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/kernels/triton/test_flash_bwd_split.py -m gpu -q \
    -p no:cacheprovider -n ${SHARDS:-4} > "$OUT/ds_gemm_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/ds_gemm_tests.log"; grep -h -E "^(FAILED|ERROR)|^E " "$OUT/ds_gemm_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/time_bwd_split.py --dims ${DSG_DIMS:-256} --ds-gemm ${DSG_ARGS:-} \
    --seqlens ${DSG_SEQLENS:-2048 8192 16384} --json "$OUT/ds_gemm.json" 2>&1 | grep -v -i warn || status=1
fi
if [[ " $steps " == *" hang256 "* ]]; then
  # forty-third session: `bench --dims 96 192 256 --seqlens 2048 8192 16384` stopped at its cell of ours at d=256
  # without a causal mask, 8k tokens (b=2, h=8), and that cell alone did not end within 140 s on the same machine.
  # The cell forward-only, then whole, with every thread's Python stack written every 15 s (stuck in a kernel, in
  # a compiler pass, or in the host code?)
  # forty-fourth session, another H100: both parts ended at once (446 / 202 TFLOP/s), and so did the whole command
  # (65 s): the forty-third session's machine, not the code
  for part in fwd whole; do
    args=""; [[ $part == fwd ]] && args="--fwd-only"
    timeout -s INT -k 10 ${HANG_TIMEOUT:-90} python3 scripts/with_stack_dumps.py --every 15 \
      --file "$OUT/stacks_$part.txt" -- fa_backend bench --backends triton --dims 256 --seqlens 8192 --causal no \
      $args > "$OUT/hang_$part.log" 2>&1
    echo "hang256 $part: rc=$?"; grep -v "it/s" "$OUT/hang_$part.log" | tail -n 4
    tail -n 30 "$OUT/stacks_$part.txt" 2>/dev/null
  done
fi
if [[ " $steps " == *" cute_order "* ]]; then
  # the causal CuTe backward's CTA order (scripts/time_cute_bwd_order.py), one process and DSL cache per setting,
  # the default first and last (drift); ORDER_SETTINGS: each word "default", "block" or an L2 section in MiB
  for o in ${ORDER_SETTINGS:-default 160 block 20 default}; do
    args=""; [[ $o == block ]] && args="--block-order"; [[ $o =~ ^[0-9]+$ ]] && args="--l2-mb $o"
    CUTE_DSL_CACHE_DIR="/tmp/order_cache_$o" timeout ${ORDER_TIMEOUT:-150} python3 scripts/time_cute_bwd_order.py \
      $args ${ORDER_ARGS:-} --json "$OUT/order_${o}_$SECONDS.json" 2>&1 | grep -v -i warn || status=1
  done
fi
if [[ " $steps " == *" cute "* ]]; then
  skip=""; [[ " $steps " == *" cute_bwd "* ]] && skip="--ignore=tests/kernels/cute/test_flash_bwd_gpu.py"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/kernels/cute tests/ops/test_cute_flash_gpu.py tests/dispatch/test_cute_eligibility.py $skip -q -p no:cacheprovider -n ${CUTE_WORKERS:-4} > "$OUT/cute_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/cute_tests.log"; grep -h -E "^(FAILED|ERROR)" "$OUT/cute_tests.log" | head -20
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_cute.py ${CUTE_BENCH_ARGS:-} --json "$OUT/bench_cute.json" \
    > "$OUT/bench_cute.log" 2>&1 || status=1
  grep -v -i warn "$OUT/bench_cute.log"
  timeout 120 python3 scripts/bench_cute.py --host 2>&1 | grep "host µs" || status=1
fi
exit $status
