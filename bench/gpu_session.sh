#!/usr/bin/env bash
# Issue 25 on one GPU: everything the issue measures, in a few device calls of < 10 minutes.
#
# One stage per call, from the repository root on the device machine (an H100 or H200 with
# jax 0.11 + CUDA, torch and transformers installed, no network):
#
#   bash bench/gpu_session.sh table    # the table: ours, the plain jit+optax step and
#                                      # HF Llama + torch.compile at its three shapes; fp8 speed
#                                      # (right after the first shape)
#   bash bench/gpu_session.sh checks   # the GPU test tier (pytest -m gpu) and the memory
#                                      # prediction of configs/lm_125m.py vs its measured peak
#                                      # (once: the tier's own memory test is left to this step)
#   bash bench/gpu_session.sh tune     # attention table (flash vs cuDNN vs XLA), profiles of
#                                      # two shapes (traces + optimized HLO), XLA option and
#                                      # remat A/Bs
#   bash bench/gpu_session.sh extra    # if device time is left: flash tiles at D128 S8192,
#                                      # scan_unroll / attention A/Bs, fp8 vs bf16 loss curves
#
# Each stage keeps to STAGE_SECONDS (default 500, so that three stages and the machine's start
# fit a session's 30 minutes of device time): every step has its own limit, and a stage's limits
# add up to at most STAGE_SECONDS - RESERVE_SECONDS (450 s: the setup's wheel install and
# version check, and a stopped step's 15 s of grace, take the rest), so each step can use its
# whole limit; a limit is still cut to the time left (a slow setup, a smaller STAGE_SECONDS),
# and a step that no longer fits is skipped and listed as such. The steps of a stage come in
# order of importance. ONLY=TEXT runs only the steps whose name contains TEXT (to finish a
# skipped one in a later call: ONLY="fp8 speed" bash bench/gpu_session.sh table). Output: $OUT/log.txt (all
# of it), $OUT/summary.txt (the lines that matter, also printed last), $OUT/env.txt (GPU,
# driver, versions), and in `tune` each profiled shape's Perfetto trace and optimized HLO
# (<shape>.perfetto.json.gz, <shape>.hlo.txt.gz): at most 7 files. Without $OUT (a plain
# shell) they go to a new directory under /tmp.
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
# then call the device tool: run(command="bash bench/gpu_session.sh table", carry=[".whl"],
# timeout_s=600), and the same for checks and tune (the machine stays warm for 30 s between
# calls: issue the next one at once). DRY_RUN=1 prints the steps with their limits and the
# stage's total against STAGE_SECONDS - RESERVE_SECONDS (exit 1 if over), running nothing.
set -u -o pipefail
stage=${1:-}
case "$stage" in table|checks|tune|extra) ;; *)
  echo "usage: bash bench/gpu_session.sh table|checks|tune|extra" >&2; exit 2;;
esac
OUT=${OUT:-$(mktemp -d /tmp/gpu_session.XXXXXX)}
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.txt
STAGE_SECONDS=${STAGE_SECONDS:-500}
RESERVE_SECONDS=50  # of a stage's time, not given to its steps (header)
deadline=$((SECONDS + STAGE_SECONDS))
budget=0  # the limits of the stage's steps, added up
PY=${PYTHON:-python3}
[[ -n ${DRY_RUN:-} ]] || { mkdir -p "$OUT" && : >"$SUMMARY"; }

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
  local left=$((deadline - SECONDS - 15))
  if ((left < 30)); then
    printf '\n## %s: skipped, %ss left in the stage\n' "$name" "$left" | tee -a "$SUMMARY"
    return 0
  fi
  ((limit > left)) && limit=$left
  printf '\n=== %s (%s, limit %ss): %s\n' "$name" "$(date +%T)" "$limit" "$*" | tee -a "$LOG"
  local t0=$SECONDS tmp
  tmp=$(mktemp)
  timeout --signal=INT --kill-after=15 "$limit" "$@" >"$tmp" 2>&1
  local rc=$?
  grep -v -E "^(WARNING|W0000|I0000|E0000)" "$tmp" >>"$LOG"
  {
    printf '\n## %s: exit %s after %ss%s\n' "$name" "$rc" "$((SECONDS - t0))" \
      "$( ((rc == 124 || rc == 137)) && echo " (stopped at its limit)")"
    grep -v -E "^(WARNING|W0000|I0000|E0000)|Warning|warn\(" "$tmp" | tail -n "$keep"
  } >>"$SUMMARY"
  echo "    exit $rc after $((SECONDS - t0))s"
  rm -f "$tmp"
}

setup() {
  [[ -n ${DRY_RUN:-} ]] && return 0
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no wheels in .whl/: fetch them as this script's header says and carry .whl" >&2
    exit 2
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
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
table)
  # Issue 25's table, one shape per process (a shape's three steps share the GPU's memory).
  # The first shape (all three runners), then fp8's speed on it (a short A/B that must not be
  # lost to the stage's deadline), then the two longer shapes.
  step "table d768 1024x32" 170 14 $P --size d768-s1024 --runners plain,ours,torch
  step "fp8 speed d768 1024x32" 80 4 $V --size d768-s1024 --vary model.fp8=false,true
  step "table d768 2048x16" 100 12 $P --size d768-s2048 --runners ours,torch
  step "table d2048 2048x4" 100 12 $P --size d2048-s2048 --runners ours,torch
  ;;
checks)
  # The tier without its memory test: that is tools.memory_check --measure on lm_125m at a
  # smaller batch, and the next step measures lm_125m as shipped (the docs' command), whose
  # line says whether it is within 10%; one measuring run per stage, not two.
  step "GPU test tier" 260 25 $PY -m pytest -m gpu -q -rA tests/test_gpu.py \
    --deselect tests/test_gpu.py::test_memory_prediction_within_ten_percent_of_the_measured_peak
  step "memory lm_125m as shipped" 190 8 $PY -m tools.memory_check \
    --config configs/lm_125m.py --topology "$TOPO" --measure
  ;;
tune)
  A="$PY bench/attention.py --reps 5 --calls 10"
  step "attention S2k/8k D64/128" 130 14 $A --seq 2048,8192 --head-dim 64,128 --packed none
  step "attention packed" 60 10 $A --seq 2048,4096 --head-dim 64 --packed docs
  step "profile two shapes" 100 30 $PY bench/step_profile.py --size d768-s1024,d2048-s2048 \
    --keep "$OUT"
  step "xla latency hiding" 50 4 $V --size d768-s1024 \
    --xla xla_gpu_enable_latency_hiding_scheduler=false,true
  step "xla triton gemm" 50 4 $V --size d768-s1024 --xla xla_gpu_enable_triton_gemm=true,false
  step "remat d768" 60 5 $V --size d768-s1024 --vary model.remat=dots,none,dots_no_batch
  ;;
extra)
  step "flash tiles D128 S8192" 100 8 $PY bench/attention.py --seq 8192 --head-dim 128 \
    --kv-heads 16 --packed none --impls flash,cudnn \
    --flash-tiles 64x64/64x64,128x32/32x64,64x128/64x64
  step "scan_unroll d768" 70 4 $V --size d768-s1024 --vary model.scan_unroll=1,12
  step "attention impl d768 2048" 90 5 $V --size d768-s2048 --vary model.attention=auto,flash,xla
  step "fp8 vs bf16 loss" 190 12 $PY -m experiments.fp8_loss --config configs/lm_125m.py \
    --seeds 0,1 --eval_every 50 --out "$OUT/fp8_loss" --workdir /tmp/fp8_loss \
    --config.steps=200 --config.data.global_batch_size=32 --config.data.micro_batch_size=0 \
    --config.data.seq_len=1024 --config.eval_sequences=32 --config.optim.warmup_steps=20
  ;;
esac
if [[ -n ${DRY_RUN:-} ]]; then
  echo "budget: ${budget}s of $((STAGE_SECONDS - RESERVE_SECONDS))s"
  exit $((budget > STAGE_SECONDS - RESERVE_SECONDS))
fi
printf '\n==== summary of stage %s (full log: %s) ====\n' "$stage" "$LOG"
cat "$SUMMARY"
