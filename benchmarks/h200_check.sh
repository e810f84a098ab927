#!/usr/bin/env bash
# A GPU round's checks, in the order that matters if time runs out: the GPU
# tests, the grid (the core claims), then masks, memory, decode, model
# shapes, sequence parallelism, the Flax/notebook/example runs and the Mosaic
# cross-lowering under the machine's JAX.
# Usage (repo root, on the H200): bash benchmarks/h200_check.sh STEP...
# With no STEP it only installs (the package, and the peers' wheels from
# .whl/ into /tmp/site, benchmarks/README.md).
# STEPs: tests tests_shards grid grid_halves masks masks_ab memory decode models fp8
#        sequence_parallel flax notebook example mosaic_lowering prepared
#        first_call fp8_tiles new_tests ragged_route vit_tiles spills ncu
# Seen on an H100 (seconds, one call each): new_tests ~140 with 14
# workers, prepared's softcap A/B ~60 a kernel, masks (Mosaic) ~300, fp8
# ~180, models of 4 cells ~120, first_call ~15; a machine's start takes
# 2-7 minutes of the 30 a session has.
# Never time while tests run: an outer `timeout` on pytest-xdist orphans its
# workers, which then share the GPU with the benchmarks (2-3x slow).
# On a machine of several GPUs, one invocation per GPU (CUDA_VISIBLE_DEVICES,
# its own OUT) runs steps side by side: install once first, then
# SKIP_INSTALL=1; DEADLINE (epoch seconds) skips the steps that would start
# after it. Per-option A/Bs of the Mosaic kernels are `tune_mosaic` runs of
# their own (`python -m benchmarks.tune_mosaic --help`).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# The GPU tests' compilations, shared between pytest workers: many tests
# compile the same default kernel or reference at one shape (every bitwise
# test's `want`), and the suite is bound by compiling. Keyed by the
# computation, so a changed kernel compiles afresh. Tests only; the
# benchmarks compile as a user would. TEST_CACHE= (empty) turns it off.
TEST_CACHE=${TEST_CACHE-"JAX_COMPILATION_CACHE_DIR=/tmp/jax_test_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5"}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Benchmark logs stay here (their tails are printed); few files come back
# from $OUT, so it holds only results and the pytest logs.
LOGS=/tmp/h200_logs${CUDA_VISIBLE_DEVICES:+_gpu$CUDA_VISIBLE_DEVICES}; mkdir -p "$LOGS"
[ -n "${SKIP_INSTALL:-}" ] || \
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
if [ -d .whl ] && [ -z "${SKIP_INSTALL:-}" ]; then  # peers' wheels (tokamax)
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
# A benchmark module written beside this script may not exist yet.
has_module() {
  [ -f "benchmarks/$1.py" ] || { echo "benchmarks/$1.py is not here: skipped"; return 1; }
}
# masks_ab's runs so far into $OUT/masks_ab.json; with "print", a table.
masks_ab_records() {
  python3 - "$OUT/masks_ab.json" "${1:-}" <<'PY'
import glob, json, os, sys
runs = []
for path in sorted(glob.glob("/tmp/masks_ab/*.json")):
  form, d, r = os.path.basename(path)[:-5].split("_")
  data = json.load(open(path))
  runs.append(dict(form=form, head_dim=int(d[1:]), round=int(r[1:]),
                   device=data.get("device"), records=data["records"]))
  for rec in data["records"] if sys.argv[2] == "print" else ():
    print(f"{form:7s} {d:5s} {r:3s} {rec['variant']:30s} {rec['mode']:8s}"
          f" {rec['ms']:8.3f} ms  x{rec['vs_against'] or 0:.3f}")
json.dump(dict(runs=runs), open(sys.argv[1], "w"), indent=1)
PY
}
for step in "$@"; do
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then
    echo "skipped $step: past DEADLINE"; continue
  fi
  echo "== $step (GPU ${CUDA_VISIBLE_DEVICES:-all}) $(date +%T)"
  case $step in
    tests)  # `pytest -m gpu`, a per-test limit instead of an outer kill;
            # on one GPU in two calls, TEST_SHARD=0/2 then 1/2 (the whole
            # suite outgrew a 10-minute call);
            # -v names every test's outcome, so a run cut short says which
            # ran; --dist load spreads one file's tests over the workers;
            # --compile-times: where the time went (tests/compile_times.py)
      env $TEST_CACHE python3 -m pytest -m gpu -n ${TEST_WORKERS:-8} --dist load -rfE --tb=short --timeout ${TEST_TIMEOUT:-240} -p no:cacheprovider \
        --durations=15 --compile-times 30 -p no:benchmark ${TEST_SHARD:+--shard $TEST_SHARD} -v \
        ${GPU_TESTS:-tests} > "$OUT/pytest_gpu.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s " "$OUT/pytest_gpu.log" | tail -30 ;;
    new_tests)  # the GPU tests of what was written since the last GPU
                # round (benchmarks/NOTES.md, Open), before the whole suite
                # NEW_TESTS the paths, NEW_TESTS_K their -k filter ("": none)
      k_filter=(); [ -z "${NEW_TESTS_K-cap or dropout}" ] \
        || k_filter=(-k "${NEW_TESTS_K-cap or dropout}")
      env $TEST_CACHE python3 -m pytest -m gpu -n ${TEST_WORKERS:-8} --dist load -rfE --tb=short \
        --timeout ${TEST_TIMEOUT:-240} -p no:cacheprovider -p no:benchmark -v ${k_filter[@]+"${k_filter[@]}"} \
        ${NEW_TESTS:-tests/test_mosaic_masked_backward_gpu.py tests/test_mosaic_lowering.py tests/test_mosaic_masked.py} \
        > "$OUT/pytest_gpu_new.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_gpu_new.log" | tail -30 ;;
    tests_shards)  # `tests` on a two-GPU host, a part of the suite on each
                   # GPU (`pytest --shard I/N`, tests/conftest.py):
                   # TEST_SHARDS="0/2 1/2" (the default) runs it all; logs
                   # $OUT/gpu0/pytest_gpu.log and $OUT/gpu1/...
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
    grid)
      # GRID_ARGS: default "--resume" (keep what --out has, measure the
      # rest); "--no-render" starts afresh. GRID_BUDGET: seconds of
      # measuring. GRID_OUT: another file (say one half of the grid per
      # GPU, GRID_ARGS="--causal full"; merge with run_grid --include).
      # GRID_ROUNDS: time each cell's implementations that many times in
      # turn, each keeping its median. GRID_IMPLS: another list.
      grid_out=${GRID_OUT:-benchmarks/results/h200.json}
      timeout $((${GRID_BUDGET:-100} + 40)) python3 -m benchmarks.run_grid \
        ${GRID_ARGS:---resume} --time-budget ${GRID_BUDGET:-100} \
        --rounds ${GRID_ROUNDS:-2} --out "$grid_out" \
        --impls ${GRID_IMPLS:-jax_flash_mosaic jax_flash_triton cudnn tokamax_mosaic tokamax_triton \
        pallas_triton_mha pallas_mgpu xla matmul} > "$LOGS/grid.log" 2>&1
      [ "$(dirname "$grid_out")" -ef "$OUT" ] || cp "$grid_out" "$OUT/"
      tail -n 45 "$LOGS/grid.log" ;;
    grid_halves)  # the whole grid on a two-GPU host in about 4 minutes:
                  # non-causal cells on GPU 0, causal on GPU 1 (GRID_ROUNDS
                  # and GRID_BUDGET as for grid), then one file,
                  # $OUT/h200.json (render it where matplotlib is:
                  # python -m benchmarks.render). Two GPUs busy at once
                  # read a few % low: for numbers of record, one GPU.
      for half in full causal; do
        gpu=0; [ $half = causal ] && gpu=1
        CUDA_VISIBLE_DEVICES=$gpu SKIP_INSTALL=1 \
          GRID_BUDGET=${GRID_BUDGET:-430} GRID_ARGS="--no-render --causal $half" \
          GRID_OUT="$OUT/grid_$half.json" bash "$0" grid > "$LOGS/grid_$half.txt" 2>&1 &
      done
      wait
      python3 -m benchmarks.run_grid --include "$OUT/grid_full.json" "$OUT/grid_causal.json" \
        --time-budget 0 --no-render --out "$OUT/h200.json" 2>&1 | tail -n 45 ;;
    masks)  # what masks save and score changes cost at 16k, on the
            # Triton path, the Mosaic one and what implementation=None runs
            # (Mosaic's 40 rows took over 220 s on an H100: 360 s each;
            # `benchmarks.masks --variants` times a few rows and their
            # yardsticks)
      for impl in ${MASKS_IMPLS:-triton mosaic auto}; do
        suffix=; [ $impl = triton ] || suffix=_$impl
        timeout ${MASKS_TIMEOUT:-360} python3 -m benchmarks.masks --implementation $impl \
          --out "$OUT/h200_masks$suffix.json" > "$LOGS/masks_$impl.log" 2>&1
        tail -18 "$LOGS/masks_$impl.log"
      done ;;
    masks_ab)  # kernel code against a base tree, in turn: rows of
               # benchmarks.masks (AB_ROWS, separated by ';'; default the
               # dropout row) at head dims AB_DIMS (default 128), AB_ROUNDS
               # rounds (default 2), MASKS_IMPL (default mosaic); the base
               # is another checkout's root, AB_BASE (say `git archive main
               # pallas_kernels jax_flash flax_layers benchmarks | tar -x
               # -C ab_base`, carried with the call). Each form runs from
               # its own tree; AB_ARGS: more arguments of benchmarks.masks
               # (say "--seq 4096"); records in $OUT/masks_ab.json.
      [ -d "${AB_BASE:-}" ] || { echo "masks_ab: AB_BASE is not a directory"; continue; }
      IFS=';' read -ra ab_rows <<< "${AB_ROWS:-causal + dropout 0.1}"
      rm -rf /tmp/masks_ab && mkdir -p /tmp/masks_ab
      for round in $(seq ${AB_ROUNDS:-2}); do
        for d in ${AB_DIMS:-128}; do
          for form in base change; do
            tree=$PWD; [ $form = base ] && tree=$(cd "$AB_BASE" && pwd)
            (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout 240 \
              python3 -m benchmarks.masks --implementation ${MASKS_IMPL:-mosaic} \
              --head-dim $d ${AB_ARGS:-} --variants "${ab_rows[@]}" \
              --out /tmp/masks_ab/${form}_d${d}_r${round}.json) > "$LOGS/masks_ab.log" 2>&1 \
              || tail -5 "$LOGS/masks_ab.log"
            masks_ab_records  # after every run: a call cut short keeps them
          done
        done
      done
      masks_ab_records print ;;
    memory)
      timeout 110 python3 -m benchmarks.memory --impls jax_flash_triton xla \
        --worker-timeout 50 --out "$OUT/h200_memory.json" > "$LOGS/memory.log" 2>&1
      tail -15 "$LOGS/memory.log" ;;
    decode)  # decode against dense and paged KV caches, every peer
      has_module decode || continue
      timeout ${DECODE_TIMEOUT:-400} python3 -m benchmarks.decode \
        --out "$OUT/h200_decode" > "$LOGS/decode.log" 2>&1
      tail -40 "$LOGS/decode.log" ;;
    models)  # the shapes real models train with (GQA, windows, soft cap,
             # ...); --resume keeps the committed cells and times the rest,
             # and those named in MODELS_REMEASURE again
      has_module models || continue
      cp benchmarks/results/h200_models.json "$OUT/h200_models.json"
      [ -z "${MODELS_REMEASURE:-}" ] || python3 - "$OUT/h200_models.json" $MODELS_REMEASURE <<'PY'
import json, sys
path, cells = sys.argv[1], set(sys.argv[2:])
result = json.load(open(path))
result["records"] = [r for r in result["records"] if r["name"] not in cells]
json.dump(result, open(path, "w"), indent=1)
PY
      timeout ${MODELS_TIMEOUT:-400} python3 -m benchmarks.models \
        ${MODELS_ARGS:---resume --time-budget 330} \
        --out "$OUT/h200_models.json" > "$LOGS/models.log" 2>&1
      tail -40 "$LOGS/models.log" ;;
    fp8)  # the FP8 forward's error against bf16's, and its speed
      timeout 120 python3 -m benchmarks.fp8_accuracy --seq ${FP8_SEQ:-4096} \
        --out "$OUT/h200_fp8_accuracy.json" > "$LOGS/fp8.log" 2>&1; tail -16 "$LOGS/fp8.log"
      timeout 160 python3 -m benchmarks.run_grid --seqs 4096 16384 --modes fwd \
        --impls jax_flash_mosaic_fp8 cudnn_fp8 jax_flash_mosaic cudnn --time-budget 110 \
        --out "$OUT/h200_fp8.json" > "$LOGS/fp8_speed.log" 2>&1
      tail -16 "$LOGS/fp8_speed.log" ;;
    sequence_parallel)  # on a machine of several GPUs
      NCCL_NVLS_ENABLE=0 XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        timeout ${SP_TIMEOUT:-540} python3 -m benchmarks.sequence_parallel ${SP_ARGS:-} \
        --out "$OUT/sequence_parallel.json" \
        > "$LOGS/sequence_parallel.log" 2>&1; tail -40 "$LOGS/sequence_parallel.log" ;;
    flax)
      python3 -m pytest -m gpu -n 3 -q -rf --tb=short --timeout 240 -p no:cacheprovider \
        --durations=10 -p no:benchmark tests/test_flax_layers.py > "$OUT/pytest_flax.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s " "$OUT/pytest_flax.log" | tail -20 ;;
    notebook)  # the committed notebook carries the GPU's outputs (the GPU
               # machine has no Jupyter: benchmarks/run_notebook.py)
      JAX_FLASH_NOTEBOOK_SIZE=${NOTEBOOK_SIZE:-full} timeout ${NOTEBOOK_TIMEOUT:-240} python3 -m \
        benchmarks.run_notebook notebooks/numerics.ipynb "$OUT/numerics.ipynb" ;;
    example)  # xla then flash, 300 steps each: ~45 s apiece with compilation
      timeout 240 python3 examples/train_lm.py --attention both --steps ${EXAMPLE_STEPS:-300} \
        --plot "$OUT/loss_curve_h200.png" > "$LOGS/example.log" 2>&1
      grep -E "final|wrote" "$LOGS/example.log" ;;
    mosaic_lowering)  # every Mosaic kernel and option cross-lowered for
                      # CUDA under this machine's JAX
      timeout 300 python3 -m benchmarks.lower_mosaic > "$LOGS/lower_mosaic.log" 2>&1
      tail -20 "$LOGS/lower_mosaic.log" ;;
    prepared)  # kernel options' A/Bs (benchmarks/NOTES.md, Open): each
               # against the default, two rounds in turn, one process a
               # length (PREPARED_SEQS) at head dims PREPARED_DIMS; by
               # default the H100's earlier decisions again on the H200,
               # PREPARED_KERNELS another list
      for seq in ${PREPARED_SEQS:-16384 4096}; do
        timeout ${PREPARED_TIMEOUT:-300} python3 -m benchmarks.tune_mosaic \
          --kernels ${PREPARED_KERNELS:-softcap_backward_folded max_free alibi_columns alibi_columns_backward} \
          --seq $seq --head-dims ${PREPARED_DIMS:-128 64} \
          --rounds 2 --budget ${PREPARED_BUDGET:-240} \
          --out "$OUT/mosaic_prepared_$seq.json" > "$LOGS/prepared_$seq.log" 2>&1
        tail -8 "$LOGS/prepared_$seq.log"
      done ;;
    ragged_route)  # the forward at lengths no tile divides, plain kernel
                   # (key tail) against masked, causal and not: the A/B
                   # behind `attention._masked`'s route for plain calls
                   # (ViT's 197 tokens at d=64; 1000 at d=64/128/256)
      for seq in 197 1000; do
        dims="64"; [ $seq = 1000 ] && dims="64 128 256"
        timeout 200 python3 -m benchmarks.tune_mosaic --kernels ragged_forward \
          --seq $seq --head-dims $dims --rounds 2 --budget 150 \
          --out "$OUT/h200_mosaic_ragged_forward_$seq.json" > "$LOGS/ragged_$seq.log" 2>&1
        tail -6 "$LOGS/ragged_$seq.log"
      done ;;
    fp8_tiles)  # the FP8 forward's K/V tile and ring depth (issue 40's
                # speed; `tune_mosaic`'s FP8_TILES_SPACE), at 16k, two
                # rounds; then `fp8` with the tile chosen
      timeout ${FP8_TILES_TIMEOUT:-560} python3 -m benchmarks.tune_mosaic \
        --kernels forward_fp8_tiles --seq ${FP8_TILES_SEQ:-16384} --head-dims 64 128 256 \
        --rounds 2 --budget ${FP8_TILES_BUDGET:-500} \
        --out "$OUT/h200_mosaic_fp8_tiles.json" > "$LOGS/fp8_tiles.log" 2>&1
      tail -12 "$LOGS/fp8_tiles.log" ;;
    vit_tiles)  # the Triton forward's tiles at ViT's lengths (197, 257,
                # 577 tokens, d=64, no mask: the shapes `api.TRITON_FIRST_UP_TO`
                # sends to Triton; its defaults were swept at 4096), each
                # at its model's batch and heads (benchmarks/models.py)
      for shape in 197:25216:768 257:16448:1024 577:18464:1024; do
        IFS=: read -r seq tokens hidden <<< "$shape"
        timeout 170 python3 -m benchmarks.tune_blocks --phases fwd --full-only \
          --head-dims 64 --seq $seq --tokens $tokens --hidden $hidden --budget 140 \
          --out "$OUT/h200_block_sweep_vit_$seq.json" > "$LOGS/vit_$seq.log" 2>&1
        grep -E "^d64|trials" "$LOGS/vit_$seq.log"
      done ;;
    first_call)  # issue 38's first call (causal fwd+VJP at 4k, 16 heads)
                 # by stage, in a process with an empty persistent
                 # compilation cache and then in one that finds it filled
      cache=$(mktemp -d)
      for run in cold warm; do
        JAX_COMPILATION_CACHE_DIR=$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
          timeout 300 python3 -m benchmarks.diagnostics.compile_probe \
          --split mosaic cudnn > "$LOGS/first_call_$run.log" 2>&1
        echo "-- $run cache"; grep -E "trace .* lower" "$LOGS/first_call_$run.log"
      done | tee "$OUT/h200_first_call_cache.txt"
      # Each kernel lowered and compiled alone (no cache): how much of
      # XLA's compile is the kernels' own (Mosaic GPU's passes, ptxas).
      timeout 200 python3 -m benchmarks.diagnostics.compile_probe --kernels \
        2>&1 | grep -E "lower .* compile" | tee -a "$OUT/h200_first_call_cache.txt" ;;
    spills)  # ptxas's registers and spill bytes of every Mosaic kernel
             # of benchmarks.masks' rows (SPILL_ROWS, separated by ';';
             # default `spill_survey.DEFAULT_ROWS`), compile only, at
             # SPILL_SEQ (4096) and head dims SPILL_DIMS (64 128 256)
      rows=(); IFS=';' read -ra rows <<< "${SPILL_ROWS:-}"
      timeout ${SPILL_TIMEOUT:-300} python3 -m benchmarks.diagnostics.spill_survey \
        --seq ${SPILL_SEQ:-4096} --head-dims ${SPILL_DIMS:-64 128 256} \
        ${rows[@]:+--rows "${rows[@]}"} --out "$OUT/spills.json" 2>&1 | tail -60 ;;
    ncu)  # Nsight Compute on one cell's kernels (NCU_CELL mode:seq:d[:causal],
          # default the causal fwd+bwd at 16k, d=128): the plain Mosaic
          # kernels (NCU_IMPLS) beside the masked ones on the same mask
          # (NCU_MASKS, rows of benchmarks.masks separated by ';'), for
          # issue 39's masked
          # kernel cost; NCU_KERNELS a regex of kernel names;
          # NCU_MODEL_CELL a cell of benchmarks.models instead (its mode
          # still NCU_CELL's, NCU_IMPLS its implementations). Details,
          # raw metrics and per-SASS samples come back, and their
          # summaries (`benchmarks.diagnostics.ncu_summary`) print.
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      [ -n "$ncu_bin" ] || { echo "no ncu on this machine"; continue; }
      IFS=: read -r mode seq d causal <<< "${NCU_CELL:-fwd_bwd:16384:128:causal}"
      name=ncu_${mode}_${seq}_${d}${causal:+_causal}
      # NCU_MASKS: rows of benchmarks.masks, several separated by ';'
      # ("none": the implementations alone, say NCU_IMPLS="jax_flash_mosaic_fp8
      # cudnn_fp8" with NCU_CELL=fwd:16384:128)
      IFS=';' read -ra mask_rows <<< "${NCU_MASKS:-causal as mask_fn}"
      cell_args=(--seq "$seq" --head-dim "$d" ${causal:+--causal})
      [ "${NCU_MASKS:-}" = none ] || cell_args+=(--masks "${mask_rows[@]}")
      if [ -n "${NCU_MODEL_CELL:-}" ]; then
        name=ncu_${mode}_$NCU_MODEL_CELL; cell_args=(--model-cell "$NCU_MODEL_CELL")
      fi
      timeout ${NCU_TIMEOUT:-400} "$ncu_bin" --profile-from-start off --clock-control none \
        ${NCU_KERNELS:+--kernel-name "regex:$NCU_KERNELS"} --set full --import-source yes \
        -f -o "/tmp/$name" python3 -m benchmarks.diagnostics.ncu_kernels --mode "$mode" \
        "${cell_args[@]}" --impls ${NCU_IMPLS:-jax_flash_mosaic} > "$LOGS/$name.log" 2>&1
      tail -5 "$LOGS/$name.log"
      "$ncu_bin" --import "/tmp/$name.ncu-rep" --page details > "$OUT/$name.txt" 2>&1
      "$ncu_bin" --import "/tmp/$name.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv" 2>&1
      "$ncu_bin" --import "/tmp/$name.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/${name}_sass.csv" 2>&1
      # XLA's small fusions (a masked call has dozens) left out of the
      # printed table, so that every attention kernel's row shows
      python3 -m benchmarks.diagnostics.ncu_summary metrics "$OUT/${name}_raw.csv" \
        | grep -v -E '^\| (input_|loop_|sort_|wrapped_)' | head -30
      python3 -m benchmarks.diagnostics.ncu_summary phases "$OUT/${name}_sass.csv" | head -60
      python3 -m benchmarks.diagnostics.ncu_summary opcodes --top 16 "$OUT/${name}_sass.csv" \
        | tee "$OUT/${name}_opcodes.md" ;;
    *) echo "unknown step: $step (see the STEPs at the top)" ;;
  esac
done
