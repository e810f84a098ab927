#!/usr/bin/env bash
# One GPU session's checks, in the order that matters if time runs out:
# GPU tests, the d=128 grid (core claims), then masks, memory, the rest.
# Usage (repo root, on the H200): bash benchmarks/h200_check.sh STEP...
# STEPs: probe pair tests tests_shards mosaic_tests mosaic tune_mosaic order schedule persistent fused fused_ab spills consumers turns forward_order masked_order one_stage turn_cost fused_stalls early_delta lean merged forward_lean sum_after_pv sum_after_pv_rest rescale rescale_masked rescale_warp fp8_rescale order_probe prefetch deferred shared ahead_causal breakdown ncu warp_map launch_order fp8 grid128 masks masks_mosaic masks_mosaic_bwd memory grid grid_halves ring
#        sequence_parallel flax notebook example
# Never time while tests run: an outer `timeout` on pytest-xdist orphans its
# workers, which then share the GPU with the benchmarks (seen once: 2-3x slow).
# On a machine of several GPUs, one invocation per GPU (CUDA_VISIBLE_DEVICES,
# its own OUT) runs steps side by side: install once first, then
# SKIP_INSTALL=1; DEADLINE (epoch seconds) skips the steps that would start
# after it.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# The GPU tests' compilations, shared between pytest workers (and calls of
# one machine): many tests compile the same default kernel or reference at
# one shape (e.g. every bitwise test's `want`), and the suite is bound by
# compiling (session 16: 12-14 workers a GPU, 100-260 s a test, most of it
# XLA's autotuner, which tests/conftest.py turns off since session 17:
# the whole suite then ran in 3 min 9 s on two GPUs). Keyed by
# the computation, so a changed kernel compiles afresh. Whether it keeps
# Mosaic GPU's compiles is unmeasured (under JAX 0.11.2 they happen within
# XLA's compile, not at a kernel's first run: tests/compile_times.py).
# Tests only; the benchmarks compile as a user would. TEST_CACHE= (empty) turns it off, for an A/B.
TEST_CACHE=${TEST_CACHE-"JAX_COMPILATION_CACHE_DIR=/tmp/jax_test_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Benchmark logs stay here (their tails are printed); at most 8 files come
# back from $OUT, so it holds only results and the pytest logs.
LOGS=/tmp/h200_logs${CUDA_VISIBLE_DEVICES:+_gpu$CUDA_VISIBLE_DEVICES}; mkdir -p "$LOGS"
[ -n "${SKIP_INSTALL:-}" ] || \
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if [ -d .whl ] && [ -z "${SKIP_INSTALL:-}" ]; then  # peers' wheels (tokamax), see benchmarks/README.md
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
  # The xprof wheel lacks xprof.cli, which tokamax imports for its own
  # benchmarking helpers only; a stub lets `import tokamax` succeed.
  if [ ! -e /tmp/site/xprof/cli ]; then
    mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/cli/__init__.py \
      && echo "get_kernel_stats_tool = None" > /tmp/site/xprof/cli/tools.py
  fi
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
# A kernel option's GPU tests (pytest arguments $2, word-split; step $1's
# log), then, only if they all pass, its A/B (tune_mosaic --kernels $3 and
# the rest of the arguments) at each of CONSUMERS_SEQS (16k, 4k, 1k).
gated_ab() {
  local name=$1 tests=$2 kernels=$3; shift 3
  env $TEST_CACHE python3 -m pytest -m gpu -n 8 --dist load -q -rf --tb=short --timeout 150 -p no:cacheprovider \
    -p no:benchmark $tests > "$OUT/pytest_$name.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_$name.log" | tail -15
  if grep -qE "failed|error" "$OUT/pytest_$name.log"; then
    echo "$name: tests failed, no A/B"; return 1
  fi
  for seq in ${CONSUMERS_SEQS:-16384 4096 1024}; do
    timeout 150 python3 -m benchmarks.tune_mosaic --seq $seq --budget 120 \
      --kernels $kernels "$@" --out "$OUT/h200_mosaic_${name}_$seq.json" \
      > "$LOGS/${name}_$seq.log" 2>&1
    grep -E "^(forward|backward|masked)" "$LOGS/${name}_$seq.log"
  done
}
for step in "$@"; do
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
    echo "skipped $step: past DEADLINE"; continue
  fi
  echo "== $step (GPU ${CUDA_VISIBLE_DEVICES:-all}) $(date +%T)"
  case $step in
    tests)  # per-test limit instead of an outer kill (see above)
      # -v: every test's outcome by name, so a run cut short still says
      # which ran (TEST_SHARD: one part of the suite, see tests_shards).
      # --dist load: pyproject's loadfile gives each file to one worker
      # (session 15: 2 of 12 workers busy, 7.5 min for 37 tests). Overall
      # no faster (session 16: 197 tests in 600 s, 14 workers a GPU;
      # session 14 by file: 198 in 540 s): compiling bound it, mostly
      # XLA's autotuner (off in tests/conftest.py since session 17: 348
      # tests in 3 min 9 s, 12 workers on each of two GPUs).
      # --compile-times says how much (tests/compile_times.py).
      env $TEST_CACHE python3 -m pytest -m gpu -n ${TEST_WORKERS:-8} --dist load -rfE --tb=short --timeout ${TEST_TIMEOUT:-240} -p no:cacheprovider \
        --durations=15 --compile-times 30 -p no:benchmark ${TEST_SHARD:+--shard $TEST_SHARD} -v \
        ${GPU_TESTS:-tests} > "$OUT/pytest_gpu.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s " "$OUT/pytest_gpu.log" | tail -30 ;;
    pair)  # two lists of steps side by side on a two-GPU host: GPU0_STEPS
           # on GPU 0 and GPU1_STEPS on GPU 1 (each with its own OUT and
           # logs), e.g. GPU0_STEPS=early_delta GPU1_STEPS=merged; each
           # GPU's files come back as one archive, $OUT/gpu0.tgz and
           # $OUT/gpu1.tgz (at most 8 files come back from $OUT)
      for gpu in 0 1; do
        steps_var=GPU${gpu}_STEPS
        mkdir -p "$OUT/gpu$gpu"
        CUDA_VISIBLE_DEVICES=$gpu SKIP_INSTALL=1 OUT="$OUT/gpu$gpu" \
          bash "$0" ${!steps_var:-} > "$OUT/gpu$gpu/steps.log" 2>&1 &
      done
      wait
      tail -n 30 "$OUT"/gpu0/steps.log "$OUT"/gpu1/steps.log
      for gpu in 0 1; do
        tar czf "$OUT/gpu$gpu.tgz" -C "$OUT" "gpu$gpu" && rm -rf "${OUT:?}/gpu$gpu"
      done ;;
    tests_shards)  # `tests` on a two-GPU host, a part of the suite on
                   # each GPU (`pytest --shard I/N`, tests/conftest.py):
                   # TEST_SHARDS="0/2 1/2" (the default) runs it all, about
                   # 3.5 minutes with XLA's autotuner off (session 17; with
                   # it on, session 16 needed three 10-minute calls). Logs
                   # $OUT/gpu0/pytest_gpu.log, $OUT/gpu1/...; `python -m
                   # benchmarks.gpu_tests_left LOGS --out FILE` lists what a
                   # cut-off run left, and GPU_TESTS=@FILE runs just that.
      shards=(${TEST_SHARDS:-0/2 1/2})
      for gpu in 0 1; do
        [ -n "${shards[$gpu]:-}" ] || continue  # one shard: GPU 0 alone
        mkdir -p "$OUT/gpu$gpu"
        CUDA_VISIBLE_DEVICES=$gpu SKIP_INSTALL=1 OUT="$OUT/gpu$gpu" \
          TEST_WORKERS=${TEST_WORKERS:-12} GPU_TESTS="${GPU_TESTS:-tests}" \
          TEST_SHARD=${shards[$gpu]} bash "$0" tests > "$LOGS/tests_gpu$gpu.txt" 2>&1 &
      done
      wait
      tail -n 12 "$LOGS"/tests_gpu0.txt "$LOGS"/tests_gpu1.txt ;;
    mosaic_tests)  # the Mosaic kernels alone (backward and FP8 are new)
      python3 -m pytest -m gpu -n 4 -q -rf --tb=short --timeout 150 -p no:cacheprovider \
        --durations=10 -p no:benchmark tests/test_mosaic_lowering.py \
        tests/test_mosaic_backward.py tests/test_mosaic_shared_rows.py tests/test_mosaic_fp8.py tests/test_mosaic_masked*.py \
        > "$OUT/pytest_mosaic.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s " "$OUT/pytest_mosaic.log" | tail -30 ;;
    mosaic)  # the Hopper path against cuDNN and tokamax, seq 16k
      timeout 200 python3 -m benchmarks.run_grid --seqs 16384 \
        --impls jax_flash_mosaic jax_flash_all_mosaic jax_flash_mosaic_fp8 \
        jax_flash_triton cudnn tokamax_mosaic \
        --time-budget 160 --out "$OUT/h200_mosaic.json" > "$LOGS/mosaic.log" 2>&1
      tail -30 "$LOGS/mosaic.log" ;;
    tune_mosaic)  # tiles and pipeline depth of the Mosaic kernels
      timeout $((${TUNE_BUDGET:-200} + 60)) python3 -m benchmarks.tune_mosaic \
        --budget ${TUNE_BUDGET:-200} --kernels ${TUNE_KERNELS:-forward backward} \
        --out "$OUT/h200_mosaic_sweep${TUNE_KERNELS:+_${TUNE_KERNELS// /_}}.json" \
        > "$LOGS/tune_mosaic.log" 2>&1; tail -8 "$LOGS/tune_mosaic.log" ;;
    order)  # causal launch order A/B (heavy tiles first), seq 16k
      timeout 200 python3 -m benchmarks.tune_mosaic --seq 16384 --budget 150 \
        --kernels forward_order backward_order --out "$OUT/h200_mosaic_order.json" \
        > "$LOGS/order.log" 2>&1; tail -8 "$LOGS/order.log" ;;
    schedule)  # consumer schedule A/Bs: forward overlap_scores, fence_softmax x
               # split_handover; backward overlap_softmax
      timeout 320 python3 -m benchmarks.tune_mosaic --seq 16384 --budget 270 \
        --kernels forward_overlap forward_schedule backward_overlap \
        --out "$OUT/h200_mosaic_schedule.json" \
        > "$LOGS/schedule.log" 2>&1; tail -12 "$LOGS/schedule.log" ;;
    fused)  # the fused dQ backward's GPU tests (14; 12 took 270 s at -n 12)
      python3 -m pytest -m gpu -n 12 -q -rf --tb=short --timeout 300 -p no:cacheprovider \
        -p no:benchmark tests/test_mosaic_backward.py -k fused > "$OUT/pytest_fused.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_fused.log" | tail -15 ;;
    fused_ab)  # its A/B against the two kernels, backward alone, 16k and 4k
      for seq in 16384 4096; do
        timeout 200 python3 -m benchmarks.tune_mosaic --seq $seq --budget 170 --head-dims 128 64 \
          --kernels backward_fused --out "$OUT/h200_mosaic_fused_$seq.json" > "$LOGS/fused_$seq.log" 2>&1
        grep "^backward" "$LOGS/fused_$seq.log"
      done ;;
    spills)  # which warpgroup of the fused dQ kernel spills (d=128 and 64):
             # ptxas's totals, and by register budget from the SASS
             # (nvdisasm is not on the machine's PATH: session 20)
      nvdisasm_bin=$(ls /usr/local/cuda*/bin/nvdisasm 2>/dev/null | head -1)
      [ -z "$nvdisasm_bin" ] || export PATH="$(dirname "$nvdisasm_bin"):$PATH"
      # PATH is not enough: Mosaic GPU runs "$root/bin/nvdisasm" with root
      # jax._src.lib.cuda_path, None on the H200 (a relative "None", session
      # 25), so the binary is linked in there too.
      root=$(python3 -c "from jax._src import lib; print(lib.cuda_path)" 2>/dev/null | tail -1)
      if [ -n "$nvdisasm_bin" ] && [ -n "$root" ] && [ ! -e "$root/bin/nvdisasm" ]; then
        mkdir -p "$root/bin" && ln -s "$nvdisasm_bin" "$root/bin/nvdisasm"
      fi
      for head_dim in 128 64; do
        MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels.mosaic.backward import mosaic_backward
d = $head_dim
q = jnp.ones((1, 2048, 4, d), jnp.bfloat16)
lse = jnp.zeros((1, 4, 2048), jnp.float32)
jax.block_until_ready(mosaic_backward(q, q, q, q, lse, q, scale=0.1,
    is_causal=False, fused_dq=True, block_q=128 if d == 64 else 64))
" > "$LOGS/sass_$head_dim.txt" 2>&1
        echo "head_dim $head_dim:"; grep -E "spill stores" "$LOGS/sass_$head_dim.txt" | sort -u
        python3 -m benchmarks.sass_spills "$LOGS/sass_$head_dim.txt"
      done ;;
    consumers)  # three consumer warpgroups in the forward
      gated_ab consumers "tests/test_mosaic_lowering.py -k three" forward_consumers \
        --head-dims ${CONSUMERS_HEAD_DIMS:-64 128} ;;
    turns)  # ring and hardware-barrier turns in the forward
      gated_ab turns "tests/test_mosaic_lowering.py -k turn_variants" forward_turns ;;
    deferred)  # the fused dQ's pieces a step later (NOTES, session 11):
               # bitwise tests, then the A/B in two rounds
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab deferred \
        "tests/test_mosaic_backward.py::test_fused_dq_is_deterministic_on_gpu tests/test_mosaic_backward.py::test_deferred_dq_is_bitwise_the_fused_kernel_on_gpu" \
        backward_deferred --head-dims 128 64 --rounds 2 ;;
    forward_order)  # the forward's launch grid tile-fastest (NOTES,
                    # session 12): bitwise tests, then the A/B against the
                    # default grid, causal, 16k and 4k, three rounds
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab forward_order \
        "tests/test_mosaic_lowering.py -k tile_fastest" forward_tile_order \
        --head-dims 128 256 --causal causal --rounds 3 ;;
    masked_order)  # the ranged (masked) kernels launched tile-fastest,
                   # on a causal 1k window: bitwise tests, then the A/B
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab masked_order \
        "tests/test_mosaic_masked.py tests/test_mosaic_masked_backward.py -k tile_fastest" \
        "masked_forward_order masked_backward_order" --rounds 3 ;;
    one_stage)  # head_dim 256's forward on 128-row K/V tiles in one stage
                # (session 13: 29-31% slower; its reference tests were
                # removed with it, so this is the A/B alone)
      for seq in ${CONSUMERS_SEQS:-16384 4096 1024}; do
        timeout 150 python3 -m benchmarks.tune_mosaic --seq $seq --budget 120 \
          --kernels forward_one_stage --head-dims 256 --rounds 2 \
          --out "$OUT/h200_mosaic_one_stage_$seq.json" > "$LOGS/one_stage_$seq.log" 2>&1
        grep "^forward" "$LOGS/one_stage_$seq.log"
      done ;;
    turn_cost)  # what the fused dQ's fixed order costs (session 13's
                # diagnostic: the unordered candidate's dQ is wrong), d=128
                # full, backward alone, 4k and 16k, three rounds
      for seq in 4096 16384; do
        timeout 150 python3 -m benchmarks.tune_mosaic --seq $seq --budget 120 \
          --kernels backward_turn_cost --head-dims 128 --causal full --rounds 3 \
          --out "$OUT/h200_mosaic_turn_cost_$seq.json" > "$LOGS/turn_cost_$seq.log" 2>&1
        tail -n 8 "$LOGS/turn_cost_$seq.log"
      done ;;
    fused_stalls)  # session 14's two from the fused dQ's stall samples
                   # (stage_free_on_read, prefetch_lse): bitwise tests,
                   # then the A/B at d=128 without a mask, three rounds
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab fused_stalls \
        "tests/test_mosaic_backward.py::test_stage_free_on_read_is_bitwise_the_fused_kernel_on_gpu tests/test_mosaic_backward.py::test_prefetched_lse_is_bitwise_the_default_on_gpu" \
        backward_fused_stalls --head-dims 128 --causal full --rounds 3 ;;
    early_delta)  # delta read early in the dK/dV kernel, and the
                  # consumers at 240 registers (session 14's, run in
                  # session 15): bitwise tests, then the A/B at d=128
                  # without a mask against the default, three rounds
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab early_delta \
        "tests/test_mosaic_backward.py::test_early_delta_is_bitwise_the_default_on_gpu tests/test_mosaic_backward.py::test_lean_producer_is_bitwise_the_default_on_gpu" \
        backward_early_delta --head-dims 128 --causal full --rounds 3 ;;
    merged)  # the fused dQ's piece issued with the next step's dV and dK
             # (session 14's, run in session 15): bitwise tests, then
             # the A/B at d=128 without a mask (fused, merged, the two
             # kernels) and at d=64's 128-row tiles, three rounds
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab merged \
        tests/test_mosaic_backward.py::test_merged_pieces_are_bitwise_the_deferred_kernel_on_gpu \
        backward_merged --head-dims 128 --causal full --rounds 3 \
        && timeout 150 python3 -m benchmarks.tune_mosaic --seq 16384 --budget 120 --rounds 3 \
          --kernels backward_merged_wide --head-dims 64 \
          --out "$OUT/h200_mosaic_merged64_16384.json" > "$LOGS/merged64.log" 2>&1 \
        && grep "^backward" "$LOGS/merged64.log" ;;
    ahead_causal)  # session 24's scores_ahead under causal masking (built
                   # off, not yet run on a GPU; NOTES' next list, 1): ptxas
                   # (C7512 / C7514 mean serialized wgmmas), the bitwise
                   # tests, then the A/B at d=64 16k and 4k, three rounds
      MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels.mosaic.backward import mosaic_backward
q = jnp.ones((1, 2048, 4, 64), jnp.bfloat16)
lse = jnp.zeros((1, 4, 2048), jnp.float32)
for persistent in (False, True):
  jax.block_until_ready(mosaic_backward(q, q, q, q, lse, q, scale=0.1,
      is_causal=True, block_q=128, persistent=persistent, scores_ahead=True))
" > "$LOGS/ptxas_ahead_causal.txt" 2>&1
      grep -E "spill stores|serialized" "$LOGS/ptxas_ahead_causal.txt" | sort -u
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab ahead_causal \
        tests/test_mosaic_backward.py::test_scores_ahead_is_bitwise_the_default_on_gpu \
        backward_ahead_causal_64 --head-dims 64 --rounds 3 ;;
    forward_lean)  # the forward's consumers at 240 registers, alone and
                   # with overlap_scores (session 14's, run in session
                   # 15): bitwise tests, then the A/B at d=128/256,
                   # 16k/4k/1k, two rounds
      gated_ab forward_lean \
        tests/test_mosaic_lowering.py::test_lean_producer_forward_is_bitwise_on_gpu \
        forward_lean --head-dims 128 256 --rounds 2 ;;
    sum_after_pv)  # the forward's row sum after P V is issued (session
                   # 15): bitwise tests, then the A/B at d=128/256,
                   # 16k/4k/1k, two rounds (session 16 ran 4k and 16k
                   # without a mask: d=128's default since)
      gated_ab sum_after_pv \
        "tests/test_mosaic_lowering.py -k sum_after_pv" \
        forward_sum_after_pv --head-dims 256 128 --rounds 2 ;;
    sum_after_pv_rest)  # where session 16 did not measure it: d=128
                        # causal, d=64, 1k, and 16k again (its tests
                        # passed then); three rounds
      for seq in ${CONSUMERS_SEQS:-16384 4096 1024}; do
        timeout 230 python3 -m benchmarks.tune_mosaic --seq $seq --budget 200 \
          --kernels forward_sum_after_pv --head-dims 128 64 --rounds ${ROUNDS:-3} \
          --out "$OUT/h200_mosaic_sum_after_pv_rest_$seq.json" \
          > "$LOGS/sum_after_pv_rest_$seq.log" 2>&1
        grep -E "^forward" "$LOGS/sum_after_pv_rest_$seq.log"
      done ;;
    rescale)  # O rescaled only where a row's max moved (session 18): its
              # GPU tests (bitwise at threshold 0, the reference at 8), then
              # the A/B at d=256/128/64, CONSUMERS_SEQS (16k 4k 1k), two rounds
      gated_ab rescale "tests/test_mosaic_lowering.py -k rescale" \
        forward_rescale --head-dims 256 128 64 --rounds ${ROUNDS:-2} ;;
    rescale_masked)  # the ranged (masked) forward's lazy rescale (session
                     # 18): its GPU tests, then the A/B on a causal 1k
                     # window at d=256/128/64, two rounds
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab rescale_masked \
        "tests/test_mosaic_masked.py -k lazy" masked_forward_rescale \
        --head-dims 256 128 64 --rounds ${ROUNDS:-2} ;;
    fp8_rescale)  # the FP8 forward's lazy rescale (session 19): its GPU
                  # accuracy tests, then the A/B at d=256/128, 16k and 4k
      CONSUMERS_SEQS=${CONSUMERS_SEQS:-16384 4096} gated_ab fp8_rescale \
        "tests/test_mosaic_fp8.py -k lazy" forward_fp8_rescale \
        --head-dims 256 128 --rounds ${ROUNDS:-2} ;;
    rescale_warp)  # the lazy rescale's skip per warp against per thread
                   # (session 19; the default since): its bitwise GPU
                   # tests, then the A/B at d=256/128, three rounds
      gated_ab rescale_warp "tests/test_mosaic_lowering.py -k per_warp" \
        forward_rescale_warp --head-dims 256 128 --rounds ${ROUNDS:-3} ;;
    lean)  # the consumers at 240 registers elsewhere: d=128 causal, d=256,
           # d=64's 128-row Q tiles (run early_delta first: its tests)
      for seq in ${CONSUMERS_SEQS:-16384 4096 1024}; do
        timeout 200 python3 -m benchmarks.tune_mosaic --seq $seq --budget 170 --rounds 2 \
          --kernels backward_lean --head-dims 128 256 \
          --out "$OUT/h200_mosaic_lean_$seq.json" > "$LOGS/lean_$seq.log" 2>&1
        timeout 120 python3 -m benchmarks.tune_mosaic --seq $seq --budget 100 --rounds 2 \
          --kernels backward_lean_wide --head-dims 64 \
          --out "$OUT/h200_mosaic_lean64_$seq.json" > "$LOGS/lean64_$seq.log" 2>&1
        grep -h "^backward" "$LOGS/lean_$seq.log" "$LOGS/lean64_$seq.log"
      done ;;
    prefetch)  # the dK/dV kernel's lse and delta read before its matmuls
      gated_ab prefetch "tests/test_mosaic_backward.py -k prefetched" backward_prefetch ;;
    shared)  # shared K/V rows in the dK/dV kernel (one pass at d=256)
      gated_ab shared tests/test_mosaic_shared_rows.py backward_shared \
        --head-dims ${SHARED_HEAD_DIMS:-256 128} ;;
    breakdown)  # fwd+bwd piece by piece beside tokamax; BREAKDOWN_CELLS
                # are seq:head_dim[:causal]
      for cell in ${BREAKDOWN_CELLS:-1024:128 1024:64 1024:256 16384:128}; do
        IFS=: read -r seq d causal <<< "$cell"
        timeout 150 python3 -m benchmarks.backward_breakdown --seq "$seq" --head-dim "$d" \
          ${causal:+--causal} 2>/dev/null | tee -a "$OUT/breakdown.md"
      done ;;
    ncu)  # Nsight Compute's full set on each kernel of NCU_CELLS
          # (mode:seq:head_dim[:causal]), ours beside the peers (NCU_IMPLS;
          # NCU_KERNELS: a regex of kernel names; NCU_ARGS: more
          # ncu_kernels arguments); each kernel's details
          # page and raw metrics come back
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      for cell in ${NCU_CELLS:-fwd_bwd:16384:128 fwd:16384:256}; do
        IFS=: read -r mode seq d causal <<< "$cell"
        name=ncu_${mode}_${seq}_${d}${causal:+_causal}
        timeout ${NCU_TIMEOUT:-200} "$ncu_bin" --profile-from-start off --clock-control none \
          ${NCU_KERNELS:+--kernel-name "regex:$NCU_KERNELS"} \
          --set full --import-source yes -f -o "/tmp/$name" python3 -m benchmarks.ncu_kernels --mode "$mode" \
          --seq "$seq" --head-dim "$d" ${causal:+--causal} \
          --impls ${NCU_IMPLS:-jax_flash_mosaic cudnn tokamax_mosaic} ${NCU_ARGS:-} > "$LOGS/$name.log" 2>&1
        tail -5 "$LOGS/$name.log"
        "$ncu_bin" --import "/tmp/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
        "$ncu_bin" --import "/tmp/$name.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv" 2>&1
        # NCU_SOURCE=1: per-SASS-instruction samples (where warps stall)
        [ -z "${NCU_SOURCE:-}" ] || "$ncu_bin" --import "/tmp/$name.ncu-rep" --page source \
          --csv --print-source sass > "$OUT/${name}_sass.csv" 2>&1
        grep -E '^  [^ ].*\(' "$OUT/$name.txt" | head -30
      done ;;
    warp_map)  # which fused-dQ role hangs as a warp (NOTES, session 8)
      timeout 300 python3 -m benchmarks.probe_warp_map --timeout 60 ;;
    launch_order)  # launch grids tile-fastest against tile-slowest (the
                   # default), forward and backward alone, seq 16k and 1k
      for seq in 16384 1024; do
        timeout 200 python3 -m benchmarks.tune_mosaic --seq $seq --budget 170 \
          --kernels forward_launch backward_launch \
          --out "$OUT/h200_mosaic_launch_$seq.json" > "$LOGS/launch_$seq.log" 2>&1
        grep "_launch" "$LOGS/launch_$seq.log" | grep -v Warn
      done ;;
    persistent)  # persistent grids against the launch grids, seq 1k/4k/16k
      for seq in 1024 4096 16384; do
        timeout 100 python3 -m benchmarks.tune_mosaic --seq $seq --budget 70 \
          --kernels ${PERSISTENT_KERNELS:-forward_persistent backward_persistent} \
          --out "$OUT/h200_mosaic_persistent_$seq.json" > "$LOGS/persistent_$seq.log" 2>&1
        grep persistent "$LOGS/persistent_$seq.log"
      done ;;
    fp8)  # FP8 error against bf16's
      timeout 120 python3 -m benchmarks.fp8_accuracy --seq ${FP8_SEQ:-4096} --out "$OUT/h200_fp8_accuracy.json" \
        > "$LOGS/fp8.log" 2>&1; tail -16 "$LOGS/fp8.log" ;;
    sequence_parallel)  # issue 7, on a machine of several GPUs
      NCCL_NVLS_ENABLE=0 XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        timeout ${SP_TIMEOUT:-540} python3 -m benchmarks.sequence_parallel ${SP_ARGS:-} \
        --out "$OUT/sequence_parallel.json" \
        > "$LOGS/sequence_parallel.log" 2>&1; tail -40 "$LOGS/sequence_parallel.log" ;;
    flax)
      python3 -m pytest -m gpu -n 3 -q -rf --tb=short --timeout 240 -p no:cacheprovider \
        --durations=10 -p no:benchmark tests/test_flax_layers.py ${FLAX_EXTRA_TESTS:-} > "$OUT/pytest_flax.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s " "$OUT/pytest_flax.log" | tail -20 ;;
    ring)
      timeout 120 python3 -m benchmarks.ring_overhead > "$LOGS/ring.log" 2>&1
      cp benchmarks/results/h200_ring_overhead.* "$OUT/"; tail -15 "$LOGS/ring.log" ;;
    probe)  # compile and run time per shape; a hang dumps its traceback
      timeout ${PROBE_TIMEOUT:-240} python3 -m benchmarks.compile_probe --hang-after 90 \
        > "$LOGS/probe.log" 2>&1; tail -60 "$LOGS/probe.log" ;;
    notebook)  # the committed notebook carries the GPU's outputs
      JAX_FLASH_NOTEBOOK_SIZE=${NOTEBOOK_SIZE:-full} timeout ${NOTEBOOK_TIMEOUT:-240} python3 -m \
        benchmarks.run_notebook notebooks/numerics.ipynb "$OUT/numerics.ipynb" ;;
    example)
      # xla then flash, 300 steps each: ~45 s apiece with compilation (seen
      # 2026-11-29; 120 s in all cut off the plot).
      timeout 240 python3 examples/train_lm.py --attention both --steps ${EXAMPLE_STEPS:-300} \
        --plot "$OUT/loss_curve_h200.png" > "$LOGS/example.log" 2>&1
      grep -E "final|wrote" "$LOGS/example.log" ;;
    grid128)
      timeout 130 python3 -m benchmarks.run_grid --head-dims 128 --seqs 4096 16384 \
        --impls jax_flash_triton pallas_triton_mha cudnn tokamax_mosaic xla matmul \
        --time-budget 95 --no-render > "$LOGS/grid128.log" 2>&1
      cp benchmarks/results/h200.json "$OUT/"; tail -25 "$LOGS/grid128.log" ;;
    masks)
      timeout 100 python3 -m benchmarks.masks > "$LOGS/masks.log" 2>&1
      cp benchmarks/results/h200_masks.* "$OUT/"; tail -18 "$LOGS/masks.log" ;;
    masks_mosaic)  # the masked Mosaic forward (Triton backward)
      timeout 100 python3 -m benchmarks.masks --implementation mosaic > "$LOGS/masks_mosaic.log" 2>&1
      cp benchmarks/results/h200_masks_mosaic.* "$OUT/"; tail -18 "$LOGS/masks_mosaic.log" ;;
    masks_mosaic_bwd)  # and the masked Mosaic backward (gated until tested)
      timeout 100 python3 -m benchmarks.masks --implementation mosaic --mosaic-masked-backward \
        > "$LOGS/masks_mosaic_bwd.log" 2>&1
      cp benchmarks/results/h200_masks_mosaic_masked_backward.* "$OUT/"; tail -18 "$LOGS/masks_mosaic_bwd.log" ;;
    memory)
      timeout 110 python3 -m benchmarks.memory --impls jax_flash_triton xla \
        --worker-timeout 50 > "$LOGS/memory.log" 2>&1
      cp benchmarks/results/h200_memory.* "$OUT/"; tail -15 "$LOGS/memory.log" ;;
    grid)
      # GRID_ARGS: default "--resume" (keep what --out has, measure the
      # rest); "--no-render" starts afresh. GRID_BUDGET: seconds of measuring.
      # jax_flash_mosaic is flash_attention's Mosaic path (Mosaic backward
      # since session 3), so jax_flash_all_mosaic is left out.
      # GRID_OUT: another file (say one half of the grid per GPU, by
      # GRID_ARGS="--causal full"; merge with run_grid --include).
      # GRID_ROUNDS: time each cell's implementations that many times in
      # turn, each keeping its median (run_grid --rounds). GRID_IMPLS:
      # another list of implementations.
      timeout $((${GRID_BUDGET:-100} + 40)) python3 -m benchmarks.run_grid \
        ${GRID_ARGS:---resume} --time-budget ${GRID_BUDGET:-100} \
        --rounds ${GRID_ROUNDS:-1} \
        --out ${GRID_OUT:-benchmarks/results/h200.json} \
        --impls ${GRID_IMPLS:-jax_flash_mosaic jax_flash_triton cudnn tokamax_mosaic tokamax_triton \
        pallas_triton_mha pallas_mgpu xla matmul} > "$LOGS/grid.log" 2>&1
      grid_out=${GRID_OUT:-benchmarks/results/h200.json}
      [ "$(dirname "$grid_out")" -ef "$OUT" ] || cp "$grid_out" "$OUT/"
      tail -n 45 "$LOGS/grid.log" ;;
    grid_halves)  # the whole grid on a two-GPU host in about 4 minutes:
                  # non-causal cells on GPU 0, causal on GPU 1 (GRID_ROUNDS,
                  # default 2, and GRID_BUDGET as for grid), then one file,
                  # $OUT/h200.json (render it where matplotlib is:
                  # python -m benchmarks.render)
      for half in full causal; do
        gpu=0; [ $half = causal ] && gpu=1
        CUDA_VISIBLE_DEVICES=$gpu SKIP_INSTALL=1 GRID_ROUNDS=${GRID_ROUNDS:-2} \
          GRID_BUDGET=${GRID_BUDGET:-430} GRID_ARGS="--no-render --causal $half" \
          GRID_OUT="$OUT/grid_$half.json" bash "$0" grid > "$LOGS/grid_$half.txt" 2>&1 &
      done
      wait
      python3 -m benchmarks.run_grid --include "$OUT/grid_full.json" "$OUT/grid_causal.json" \
        --time-budget 0 --no-render --out "$OUT/h200.json" 2>&1 | tail -n 45 ;;
    order_probe)  # does the kernel timed before move a timing (session
                  # 19: 2-12% slower after the dense matmul than after a
                  # pause, the clocks follow the power cap): raw, then with
                  # time_fn's settle, 2 cells and 2 rounds each (session
                  # 19's raw run: 3 cells with fwd:4096:256, 3 rounds)
      for settle in 0 250; do
        timeout 200 python3 -m benchmarks.order_probe --cells ${PROBE_CELLS:-fwd:4096:128 fwd:1024:64} \
          --impls jax_flash_mosaic cudnn tokamax_mosaic --rounds 2 --settle-ms $settle \
          --out "$OUT/h200_order_probe_settle$settle.json" > "$LOGS/order_probe_$settle.log" 2>&1
        tail -n 22 "$LOGS/order_probe_$settle.log"
      done ;;
    *) echo "unknown step: $step (see the STEPs at the top)" ;;
  esac
done
