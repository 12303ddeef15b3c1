#!/usr/bin/env bash
# Issue 34 on one GPU: everything the issue measures, in two device calls.
#
# From the repository root on the device machine (an H100 or H200 with jax + CUDA, torch and
# transformers installed, no network):
#
#   bash bench/gpu_session.sh all       # < 9 minutes: the table (ours, the plain
#                                       # jit+optax step, and HF Llama + torch.compile at its
#                                       # three shapes; the plain step fed ours' segment ids
#                                       # at the first), the attention table (flash vs cuDNN,
#                                       # S 2k/8k x D 64/128, packed and not), then the GPU
#                                       # test tier and the memory check of configs/lm_125m.py
#                                       # side by side (neither is timed); one summary
#   bash bench/gpu_session.sh profile   # the second call: the chunked loss's cost, fp8's speed,
#                                       # and a step profile (trace + optimized HLO kept)
#   bash bench/gpu_session.sh extra     # if a later session has device time: XLA option and
#                                       # remat A/Bs, flash tiles, attention in the step, fp8 loss
#
# Each stage keeps to STAGE_SECONDS (all: 540, profile: 200, extra: 500): every step has its own
# limit, and a stage's limits add up to at most STAGE_SECONDS - RESERVE_SECONDS (50 s for all
# and extra, 20 s for profile: the setup's wheel install and version check, a stopped step's 15
# s of grace), steps run side by side (`together`) counting once, at their longer limit; a limit
# is still cut to the time left and a step that no longer fits is skipped and listed as such.
# The steps of a stage come in order of importance. ONLY=TEXT runs only the steps whose name
# contains TEXT (to finish a skipped one later: ONLY="attention" bash bench/gpu_session.sh all).
# Output: $OUT/log.txt (all of it), $OUT/summary.txt (the lines that matter, also printed last),
# $OUT/env.txt (GPU, driver, versions), and in `profile` the profiled shape's Perfetto trace and
# optimized HLO (<shape>.perfetto.json.gz, <shape>.hlo.txt.gz): at most 5 files. Without $OUT
# (a plain shell) they go to a new directory under /tmp. A device session is 15 minutes with
# the machine's start: `all` then `profile` at once (the machine stays warm for 30 s).
#
# The machine lacks grain, array-record, ml-collections, tensorboardX, portpicker and dm-tree:
# they travel as wheels in .whl/ (the `run` call names ".whl" in `carry`). Fetch them once on
# the developer machine, in the repository root (pip works there):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux1_x86_64 -d .whl grain==0.2.18 array-record==0.8.6 \
#       ml-collections==1.1.0 tensorboardX==2.6.5 portpicker==1.6.0 dm-tree==0.1.9
#
# then call the device tool: run(command="bash bench/gpu_session.sh all", carry=[".whl"],
# timeout_s=600), and at once run(command="bash bench/gpu_session.sh profile", carry=[".whl"],
# timeout_s=260). DRY_RUN=1 prints the steps with their limits and the stage's total against
# STAGE_SECONDS - RESERVE_SECONDS (exit 1 if over), running nothing.
set -u -o pipefail
stage=${1:-}
case "$stage" in
all) default_seconds=540 RESERVE_SECONDS=50 ;;
profile) default_seconds=200 RESERVE_SECONDS=20 ;;
extra) default_seconds=500 RESERVE_SECONDS=50 ;;
*) echo "usage: bash bench/gpu_session.sh all|profile|extra" >&2; exit 2 ;;
esac
if [[ -n ${DRY_RUN:-} ]]; then OUT=${OUT:-\$OUT}; else OUT=${OUT:-$(mktemp -d /tmp/gpu_session.XXXXXX)}; fi
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.txt
STAGE_SECONDS=${STAGE_SECONDS:-$default_seconds}
deadline=$((SECONDS + STAGE_SECONDS))
budget=0  # the limits of the stage's steps, added up (steps side by side count once)
PY=${PYTHON:-python3}
[[ -n ${DRY_RUN:-} ]] || { mkdir -p "$OUT" && : >"$SUMMARY"; }

# limit_of LIMIT: LIMIT cut to the stage's time left (minus a stopped step's grace), or
# nothing when less than 30 s is left.
limit_of() {
  local left=$((deadline - SECONDS - 15))
  ((left < 30)) && return 1
  echo $(($1 < left ? $1 : left))
}

# report NAME KEEP RC T0 TMP: the step's output into the log, its last KEEP lines (and how it
# ended) into the summary.
report() {
  local name=$1 keep=$2 rc=$3 t0=$4 tmp=$5
  grep -v -E "^(WARNING|W0000|I0000|E0000)" "$tmp" >>"$LOG"
  {
    printf '\n## %s: exit %s after %ss%s\n' "$name" "$rc" "$((SECONDS - t0))" \
      "$( ((rc == 124 || rc == 137)) && echo " (stopped at its limit)")"
    grep -v -E "^(WARNING|W0000|I0000|E0000)|Warning|warn\(" "$tmp" | tail -n "$keep"
  } >>"$SUMMARY"
  echo "    $name: exit $rc after $((SECONDS - t0))s"
  rm -f "$tmp"
}

# step NAME LIMIT KEEP CMD...: run CMD within LIMIT seconds (less if less time is left), all of
# its output into the log, its last KEEP lines into the summary.
step() {
  local name=$1 limit=$2 keep=$3
  shift 3
  [[ -n ${ONLY:-} && $name != *"$ONLY"* ]] && return 0
  budget=$((budget + limit))
  if [[ -n ${DRY_RUN:-} ]]; then
    echo "$name [${limit}s]: $*"
    return 0
  fi
  if ! limit=$(limit_of "$limit"); then
    printf '\n## %s: skipped, %ss left in the stage\n' "$name" "$((deadline - SECONDS))" \
      | tee -a "$SUMMARY"
    return 0
  fi
  printf '\n=== %s (%s, limit %ss): %s\n' "$name" "$(date +%T)" "$limit" "$*" | tee -a "$LOG"
  local t0=$SECONDS tmp
  tmp=$(mktemp)
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$tmp" 2>&1
  report "$name" "$keep" $? "$t0" "$tmp"
}

# together NAME1 LIMIT1 KEEP1 CMD1 -- NAME2 LIMIT2 KEEP2 CMD2: two steps side by side (for
# steps that time nothing: the GPU's memory and cores are shared, its clock is not read); they
# count once in the budget, at the longer limit.
together() {
  local a=() b=() seen=0
  for arg in "$@"; do
    if [[ $arg == -- ]]; then seen=1; elif ((seen)); then b+=("$arg"); else a+=("$arg"); fi
  done
  local names=("${a[0]}" "${b[0]}") limits=("${a[1]}" "${b[1]}") keeps=("${a[2]}" "${b[2]}")
  local cmds=("${a[*]:3}" "${b[*]:3}") i run=()
  for i in 0 1; do
    [[ -n ${ONLY:-} && ${names[i]} != *"$ONLY"* ]] || run+=("$i")
  done
  ((${#run[@]})) || return 0
  local most=0
  for i in "${run[@]}"; do ((limits[i] > most)) && most=${limits[i]}; done
  budget=$((budget + most))
  if [[ -n ${DRY_RUN:-} ]]; then
    for i in "${run[@]}"; do echo "${names[i]} [${limits[i]}s, side by side]: ${cmds[i]}"; done
    return 0
  fi
  local pids=() tmps=() t0=$SECONDS limit
  for i in "${run[@]}"; do
    if ! limit=$(limit_of "${limits[i]}"); then
      printf '\n## %s: skipped, %ss left in the stage\n' "${names[i]}" \
        "$((deadline - SECONDS))" | tee -a "$SUMMARY"
      pids+=("") tmps+=("")
      continue
    fi
    printf '\n=== %s (%s, limit %ss, side by side): %s\n' "${names[i]}" "$(date +%T)" \
      "$limit" "${cmds[i]}" | tee -a "$LOG"
    tmps+=("$(mktemp)")
    # shellcheck disable=SC2086  # the command's words, as `step` runs them
    timeout --signal=INT --kill-after=15 "$limit" ${cmds[i]} >"${tmps[-1]}" 2>&1 &
    pids+=("$!")
  done
  local k=0 rc
  for i in "${run[@]}"; do
    if [[ -n ${pids[k]} ]]; then
      wait "${pids[k]}"
      rc=$?
      report "${names[i]}" "${keeps[i]}" "$rc" "$t0" "${tmps[k]}"
    fi
    k=$((k + 1))
  done
}

setup() {
  [[ -n ${DRY_RUN:-} ]] && return 0
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no wheels in .whl/: fetch them as this script's header says and carry .whl" >&2
    exit 2
  fi
  # the machine stays warm between calls: the second call finds the wheels installed
  [[ -d /tmp/site/grain ]] || $PY -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu
  export TF_CPP_MIN_LOG_LEVEL=2
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -c "import sys, jax, jaxlib, flax, optax, orbax.checkpoint as o, torch, transformers
print('python', sys.version.split()[0]); print('jax', jax.__version__, jaxlib.__version__)
print('flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__)
print('torch', torch.__version__, 'transformers', transformers.__version__)
print('devices', jax.devices())"
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt" | tee -a "$SUMMARY"
}

setup
# tools.aot's own H100 description where the GPU is one (what a user checks before launch), else
# the local GPU as the compile target.
TOPO=local
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q "H100" && TOPO=h100:1
P="$PY bench/peers.py --rounds 3 --steps 5"
V="$PY bench/variants.py --rounds 3 --steps 5"
case "$stage" in
all)
  # The issue's table. The first shape also runs the plain step fed ours' segment ids
  # (plain-docs): ours/plain-docs is our step's own cost, plain-docs/plain the documents'.
  # The two other shapes in one process (one start-up of jax and torch for both).
  step "table d768 1024x32" 140 16 $P --size d768-s1024 --runners plain,plain-docs,ours,torch
  step "table d768 2048x16, d2048 2048x4" 160 16 $P --size d768-s2048,d2048-s2048 \
    --runners plain,ours,torch
  # our kernels (flash: the Mosaic GPU one on Hopper; flash_triton) vs cuDNN (XLA's [S, S]
  # attention is no contender at 8k); each case checked on a slice before it is timed
  step "attention S2k/8k D64/128 packed and not" 60 22 $PY bench/attention.py --reps 3 \
    --calls 5 --seq 2048,8192 --head-dim 64,128 --kv-heads 16 --packed none,docs \
    --impls flash,flash_triton,cudnn
  # The tier without its memory test (tools.memory_check --measure on lm_125m at a smaller
  # batch): the memory step beside it measures lm_125m as shipped, the docs' command, once.
  together "GPU test tier" 130 25 $PY -m pytest -m gpu -q -rA tests/test_gpu.py \
    --deselect tests/test_gpu.py::test_memory_prediction_within_ten_percent_of_the_measured_peak \
    -- "memory lm_125m as shipped" 130 8 $PY -m tools.memory_check \
    --config configs/lm_125m.py --topology "$TOPO" --measure
  ;;
profile)
  # issue 34's goal 3: the chunked loss within 2% of the unchunked step; fp8's three GEMMs on
  # cuBLASLt; where the step's time goes (the trace and HLO kept for offline attribution)
  step "chunked loss d768 1024x32" 60 4 $V --size d768-s1024 --vary model.logits_chunk=0,256
  step "fp8 speed d768 1024x32" 60 4 $V --size d768-s1024 --vary model.fp8=false,true
  step "profile d768 1024x32" 60 16 $PY bench/step_profile.py --size d768-s1024 --keep "$OUT"
  ;;
extra)
  step "attention in the step d768 1024x32" 80 5 $V --size d768-s1024 \
    --vary model.attention=auto,flash,cudnn
  step "xla triton gemm" 60 4 $V --size d768-s1024 --xla xla_gpu_enable_triton_gemm=true,false
  step "xla latency hiding" 60 4 $V --size d768-s1024 \
    --xla xla_gpu_enable_latency_hiding_scheduler=false,true
  step "remat d768" 70 5 $V --size d768-s1024 --vary model.remat=dots,none,dots_no_batch
  step "flash tiles D128 S8192" 80 8 $PY bench/attention.py --seq 8192 --head-dim 128 \
    --kv-heads 16 --packed none --impls flash,flash_triton,cudnn \
    --flash-tiles 64x64/64x64,128x32/32x64,64x128/64x64
  step "fp8 vs bf16 loss" 100 12 $PY -m experiments.fp8_loss --config configs/lm_125m.py \
    --seeds 0,1 --eval_every 50 --out "$OUT/fp8_loss" --workdir /tmp/fp8_loss \
    --config.steps=100 --config.data.global_batch_size=32 --config.data.micro_batch_size=0 \
    --config.data.seq_len=1024 --config.eval_sequences=32 --config.optim.warmup_steps=20
  ;;
esac
if [[ -n ${DRY_RUN:-} ]]; then
  echo "budget: ${budget}s of $((STAGE_SECONDS - RESERVE_SECONDS))s"
  exit $((budget > STAGE_SECONDS - RESERVE_SECONDS))
fi
printf '\n==== summary of stage %s (full log: %s) ====\n' "$stage" "$LOG"
cat "$SUMMARY"
