#!/usr/bin/env bash
# The CUDA tests and every GPU measurement of the docs, a slice at a time, each call going on where the last stopped:
#
#   bash benchmarks/cuda_all.sh OUT_DIR [SECONDS]
#   COMMIT=0123abc bash benchmarks/cuda_all.sh OUT_DIR 540   # a copy without .git of the checkout at commit 0123abc
#   DEVICE=cpu bash benchmarks/cuda_all.sh OUT_DIR 900           # the dry run on the CPU
#   DEVICE=cpu SMOKE=1 bash benchmarks/cuda_all.sh OUT_DIR 60    # its smallest form
#
# from the repository root, on a machine with one NVIDIA GPU. The slices (benchmarks/cuda_slices.py: what each
# measures, in the order a call runs them; `python benchmarks/cuda_slices.py pending` lists those left) are the
# parts of cuda_suite.sh, cuda_step_time.sh, cuda_offload.sh, cuda_deepspeed.sh and cuda_quality_at_scale.sh:
# first the CUDA tests, the correctness gate (run again whenever the package or the tests changed; while they
# fail nothing is measured), then the measurements in order of value. A slice not recorded as done in
# benchmarks/runs/cuda_all/state.json runs if the time it needs fits in what is left of SECONDS (default 540),
# each of its commands under `timeout`; one that does not fit is left for the next call. When a slice ends, its
# docs sections and run caches are written, its state (the GPU, the commit, the date) goes into the state file,
# the table of slices on docs/benchmarks/index.md and the GPU statuses of the feature pages, and each docs
# section it wrote gets a first line naming the GPU and the commit. The two quality slices are resumable: each
# run is cached when it ends, and a run that would not finish in the time left waits for the next call.
#
# OUT_DIR gets at most four files, written again after each slice: tree.tgz (every file of the checkout the call
# changed, by its path: `tar xzf OUT_DIR/tree.tgz` at the root of another checkout brings the results there),
# logs.tgz (each slice's log, the GPU's description), status.txt (what each slice did, what waits), and
# running.log (the log of a slice cut off while it ran).
#
# Settings, from the environment: COMMIT (the commit recorded where `git rev-parse HEAD` does not work here),
# REDO and SKIP (slices, space-separated, to run again though done / not to run in this call), GATE=0 (measure
# even where the CUDA tests failed), WHEELS=DIR (the wheels in DIR installed first: the 8-bit peers, deepspeed).
#
# DEVICE=cpu: the dry run on the CPU. It runs in a fresh copy of the checkout in a scratch folder (the checkout
# is left as it is), with the OUT_DIR/tree.dry-run.tgz of an earlier dry run unpacked over it (so a later dry run
# goes on where the last stopped, as a GPU call does once its tree.tgz is unpacked into the checkout): the test
# selection collected, every measurement in its smallest form on the CPU, each slice recorded as a dry run (never
# shown as a GPU's). Its results go to OUT_DIR/tree.dry-run.tgz, which is not for the checkout. SMOKE=1 with it:
# each measurement's commands checked, not run (the script exists and takes every flag given).
set -u
out=${1:?usage: bash benchmarks/cuda_all.sh OUT_DIR [SECONDS]}
budget=${2:-540}
reserve=15  # seconds kept for the last slice's bookkeeping
start=$(date +%s)
mkdir -p "$out"
out=$(cd "$out" && pwd)
dry=0 smoke=${SMOKE:-0} dev=cuda
if [ "${DEVICE:-cuda}" = cpu ]; then dry=1 dev=cpu; fi
if [ "$dry" = 0 ]; then smoke=0; fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/logs"
if [ -f "$out/logs.tgz" ]; then tar xzf "$out/logs.tgz" -C "$scratch"; fi  # an earlier call's logs into this OUT_DIR kept
status=$out/status.txt
: > "$status"
rm -f "$out/running.log"

say() { echo "== $(date +%T) (+$(($(date +%s) - start)) s) $*" | tee -a "$status"; }
left() { echo $((budget - ($(date +%s) - start))); }

commit=${COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
code_changes=$(git status --porcelain --untracked-files=no -- lightning_baoc tests benchmarks ':!benchmarks/runs' 2>/dev/null)
if [ -z "${COMMIT:-}" ] && [ "$commit" != unknown ] && [ -n "$code_changes" ]; then
  commit="$commit (with uncommitted changes)"
fi
if [ "$dry" = 1 ]; then
  device="cpu (dry run)"
  work=$scratch/checkout
  mkdir -p "$work"
  if git rev-parse --is-inside-work-tree > /dev/null 2>&1; then  # tracked and untracked files, not the ignored ones
    git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar xf - -C "$work"
  else
    tar cf - --exclude=.git --exclude=__pycache__ . | tar xf - -C "$work"
  fi
  cd "$work" || exit 2
else
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  [ -n "$device" ] || device=$(python3 -c "import torch; print(torch.cuda.get_device_name(0))" 2>/dev/null)
  if [ -z "$device" ]; then
    echo "no GPU is visible here (DEVICE=cpu runs the dry run on the CPU)" | tee -a "$status"
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8 DS_BUILD_OPS=0
flags=()
if [ "$dry" = 1 ]; then flags+=(--dry-run); fi
helper() { python3 benchmarks/cuda_slices.py --scratch "$scratch" "${flags[@]}" "$@"; }

# ------------------------------------------------------------------------------ within a slice

slice_deadline=0
rest() { echo $((slice_deadline - $(date +%s) - ${hold:-0})); }
within() {  # COMMAND...: run in what is left of the slice's time, less $hold seconds kept for what follows
  local limit
  limit=$(rest)
  if [ "$limit" -le 0 ]; then echo "no time left for: $*"; return 124; fi
  timeout -k 10 "$limit" "$@"
}
run() {  # COMMAND...: a measurement's command, within the slice's time; under SMOKE=1 checked, not run
  if [ "$smoke" = 1 ]; then python3 benchmarks/cuda_slices.py check -- "$@"; else within "$@"; fi
}
quick=()  # the dry run's step times: small, no docs written (step_time.py --quick)
if [ "$dry" = 1 ]; then quick=(--quick); fi

# ------------------------------------------------------------------------------ the slices (cuda_slices.SLICES)

TESTS=(tests/integrations/test_cuda.py tests/optim/test_graph_step.py
  tests/optim/test_offload_schedule.py::test_on_cuda_every_schedule_steps_as_the_cpu_s_fp32_step
  tests/optim/test_conversion_memory.py tests/kernels/test_step_decisions.py tests/costs/test_instruments.py
  tests/costs/test_calibration.py tests/report/test_memory.py
  tests/benchmarks/test_peak_memory.py::test_the_peak_over_the_steady_state_is_within_adamws_own_plus_a_third_of_a_byte
  tests/benchmarks/test_peak_memory.py::test_the_planned_peak_is_the_measured_allocated_peak_within_5_percent)

slice_cuda_tests() {  # the CUDA tests of the five scripts; on the CPU they skip, so the dry run collects them
  local rc
  if [ "$dry" = 1 ]; then
    within python3 -m pytest --collect-only -q -p no:cacheprovider "${TESTS[@]}"; rc=$?
  else
    within python3 -m pytest -q -p no:cacheprovider -rs --durations=15 "${TESTS[@]}"; rc=$?
  fi
  tail -n 1 "$out/running.log" | tr -d '=' | sed 's/^ *//; s/ *$//' > "$scratch/detail"
  return $rc
}

step_time() {  # ARGS...: benchmarks/step_time.py as cuda_step_time.sh runs it (section step_time_<shapes>_cuda)
  run python3 benchmarks/step_time.py --device "$dev" --threads 1 --rounds 5 --steps 3 --warmup 3 "${quick[@]}" "$@"
}
slice_step_time_gpt2() { step_time --shapes gpt2-small; }
slice_step_time_ragged() { step_time --shapes ragged; }
slice_step_time_many() { step_time --shapes many; }

slice_offload_schedule() {  # as cuda_offload.sh, the CPU's AdamW on every core; its tables into docs/optimizer.md
  local dir=benchmarks/runs/offload_schedule_$dev tiny=()
  if [ "$dry" = 1 ]; then tiny=(--tiny); fi
  (export OMP_NUM_THREADS; OMP_NUM_THREADS=$(nproc)
   run python3 benchmarks/offload_schedule.py --out "$dir" "${tiny[@]}") || return
  if [ "$smoke" = 1 ]; then return 0; fi
  python3 benchmarks/cuda_slices.py section optimizer.md "offload_schedule_$dev" "$dir/offload_schedule.md"
}

slice_deepspeed_memory() {  # as cuda_deepspeed.sh (its tests run on CPU ranks: left to the CPU's test runs)
  local small=()
  if [ "$dry" = 1 ]; then small=(--size tiny --stages 2 --steps 4); fi
  if [ "$smoke" != 1 ] && ! python3 -c "import deepspeed" > /dev/null 2>&1; then
    echo "deepspeed is not installed" > "$scratch/detail"; return 76
  fi
  run python3 benchmarks/deepspeed_memory.py --accelerator "$dev" "${small[@]}" --docs \
    --out "benchmarks/runs/deepspeed_memory_$dev.json"
}

slice_suite_step_time() {  # as cuda_suite.sh, alone on the GPU (timings): the profile, then fp32 and bf16 weights
  local rc=0
  local step=(python3 benchmarks/step_time.py --device "$dev" --threads 1 --rounds 5 --steps 2 --warmup 2 "${quick[@]}")
  if [ "$dry" = 1 ]; then  # the profile needs a GPU: checked only
    python3 benchmarks/cuda_slices.py check -- python3 benchmarks/cuda_profile.py || rc=$?
  else
    within python3 benchmarks/cuda_profile.py || rc=$?
  fi
  run "${step[@]}" || rc=$?
  run "${step[@]}" --bf16-weights || rc=$?
  return $rc
}

slice_suite_memory() {  # as cuda_suite.sh: total memory beside the peak-memory runs (none of them a timing)
  local rc=0 total small=() peak=(--layers 40) excess=()
  if [ "$dry" = 1 ]; then small=(--layers 2 --steps 2) peak=(--layers 2 --width 64) excess=(--layers 2 --width 64); fi
  run python3 benchmarks/total_memory.py --device "$dev" --docs "${small[@]}" &
  total=$!
  (r=0
   run python3 benchmarks/peak_memory.py --excess --accelerator "$dev" --docs "${excess[@]}" || r=$?
   if [ "$dry" = 0 ]; then run python3 benchmarks/peak_memory.py --planned --accelerator "$dev" --docs || r=$?; fi
   run python3 benchmarks/peak_memory.py --accelerator "$dev" --docs "${peak[@]}" || r=$?
   exit $r) || rc=$?
  wait "$total" || rc=$?
  return $rc
}

slice_suite_quality() {  # as cuda_suite.sh: one process per workload, recipe and seed, 14 at a time, each run cached
  local rc jobs=$scratch/quality_jobs.txt seeds="0 1 2" recipes="realistic stress" workloads="char_gpt ddpm_digits"
  local bf16_rows="bf16mixed_adamw bf16w_adamw bf16w_int8 bf16w_int8_ecc8 bf16w_baoc_0.15 bf16w_baoc_0.15_defaults"
  local sgd_lion_rows="sgd_fp32 sgd_bf16w_int8_ecc8 sgd_bf16w_int8 lion_fp32 lion_bf16w_int8_ecc8 lion_bf16w_int8"
  local small="" report="" parallel=14
  if [ "$dry" = 1 ]; then
    seeds=0 recipes=realistic workloads=char_gpt bf16_rows=bf16w_int8_ecc8 sgd_lion_rows="sgd_fp32 sgd_bf16w_int8_ecc8"
    small="--steps 4" report="--seeds 0 --recipes realistic --steps 4" parallel=1
  fi
  : > "$jobs"
  for seed in $seeds; do
    for recipe in $recipes; do
      for w in $workloads; do
        echo "bf16_weights.py --accelerator $dev --workloads $w --recipes $recipe --seeds $seed --rows $bf16_rows" \
          "$small" >> "$jobs"
      done
      echo "sgd_lion.py --accelerator $dev --recipes $recipe --seeds $seed --rows $sgd_lion_rows $small" >> "$jobs"
    done
  done
  if [ "$smoke" = 1 ]; then
    rc=0
    while read -r job; do run python3 benchmarks/$job || rc=$?; done < "$jobs"
    run python3 benchmarks/bf16_weights.py --accelerator "$dev" --report-only --docs --workloads $workloads \
      --rows $bf16_rows $report || rc=$?
    run python3 benchmarks/sgd_lion.py --accelerator "$dev" --report-only --docs --rows $sgd_lion_rows $report || rc=$?
    return $rc
  fi
  hold=90 within xargs -P "$parallel" -I{} sh -c \
    'python3 benchmarks/{} > "'"$scratch"'/logs/q_$(echo "{}" | tr -c "a-z0-9" _ | cut -c1-90).log" 2>&1' < "$jobs"
  rc=$?
  # the tables from the cached runs, whatever finished
  within python3 benchmarks/bf16_weights.py --accelerator "$dev" --report-only --docs --workloads $workloads \
    --rows $bf16_rows $report || rc=$?
  within python3 benchmarks/sgd_lion.py --accelerator "$dev" --report-only --docs --rows $sgd_lion_rows $report || rc=$?
  if [ "$rc" = 124 ]; then return 75; fi
  return $rc
}

slice_quality_at_scale() {  # as cuda_quality_at_scale.sh, a run at a time (peers from WHEELS only: no index is reached)
  local run_args rc=0
  if [ "$smoke" = 1 ]; then
    run python3 benchmarks/quality_at_scale.py --device cpu --size tiny --rows fp32 --seeds 0 || rc=$?
    run python3 benchmarks/quality_at_scale.py --report-only --docs || rc=$?
    return $rc
  fi
  while :; do
    run_args=$(python3 benchmarks/cuda_slices.py --on "$dev" --left "$(hold=60 rest)" "${flags[@]}" \
      --detail-file "$scratch/detail" quality-next) || { rc=1; break; }
    [ -n "$run_args" ] || break
    set -- $run_args  # SIZE ROW SEED
    echo "quality at scale: $*"
    hold=60 within python3 benchmarks/quality_at_scale.py --device "$dev" --size "$1" --rows "$2" --seeds "$3" \
      || { rc=$?; break; }
  done
  within python3 benchmarks/quality_at_scale.py --report-only --docs || rc=$?
  python3 benchmarks/cuda_slices.py --on "$dev" --left 0 "${flags[@]}" --detail-file "$scratch/detail" quality-next \
    > /dev/null  # the plan's progress, for the state
  if [ "$rc" = 124 ]; then return 75; fi  # a run cut off by the time: the next call runs it again
  if [ "$rc" != 0 ]; then return $rc; fi
  grep -q "^\([0-9]*\) of \1 runs" "$scratch/detail" || return 75  # runs of the plan not on disk yet: the next call goes on
}

# ------------------------------------------------------------------------------ the call

say "cuda_all on ${device}, commit ${commit}, ${budget} s; $(date -u +%F)"
if [ "$smoke" != 1 ]; then
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    if [ -n "${WHEELS:-}" ]; then  # every wheel there (the 8-bit peers, deepspeed), with nothing fetched
      python3 -m pip install -q --no-index --no-deps "$WHEELS"/*.whl 2>&1
    fi
    python3 - <<'EOF' 2>&1
import importlib
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
print("torch", torch.__version__, "cuda", torch.version.cuda, gpu)
for name in ("lightning", "triton", "deepspeed", "bitsandbytes", "torchao", "flashoptim"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as err:  # noqa: BLE001 - a peer missing is a line of the log
        print(name, "unavailable:", type(err).__name__)
EOF
  } > "$scratch/logs/gpu.txt"
fi
choose=(--redo "${REDO:-}" --skip "${SKIP:-}")
if [ "$smoke" = 1 ]; then choose+=(--smoke); fi
if [ "${GATE:-1}" = 0 ]; then choose+=(--no-gate); fi
failed=0
resume=()  # an earlier dry run's results, unpacked into the copy to go on from them
if [ "$dry" = 1 ]; then resume=(--unpack "$out/tree.dry-run.tgz"); fi
next=$(helper "${choose[@]}" "${resume[@]}" --left $(($(left) - reserve)) begin)
while [ -n "$next" ]; do
  read -r name limit <<< "$next"
  say "$name (at most $limit s)"
  slice_deadline=$(($(date +%s) + limit))
  began=$(date +%s)
  rm -f "$scratch/detail"
  "slice_$name" > "$out/running.log" 2>&1
  rc=$?
  took=$(($(date +%s) - began))
  case $rc in
    0) outcome=done ;;
    75) outcome=partial ;;
    76) outcome=unavailable ;;
    *) outcome=failed failed=1 ;;
  esac
  detail=$(head -n 1 "$scratch/detail" 2>/dev/null)
  if [ "$outcome" = failed ]; then
    detail="${detail:+$detail; }exit $rc$([ "$rc" = 124 ] && echo ": out of time"), log $name.log"
  fi
  mv "$out/running.log" "$scratch/logs/$name.log"
  next=$(helper "${choose[@]}" --left $(($(left) - reserve)) --device "$device" --commit "$commit" \
    --date "$(date -u +%F)" --seconds "$took" --detail "$detail" --out "$out" finish "$name" "$outcome" 2>> "$status")
  tail -n 1 "$status"
  tar czf "$out/logs.tgz" -C "$scratch" logs
done
{
  cat "$scratch/waiting.txt" 2>/dev/null
  if [ -s "$scratch/changed.txt" ]; then
    if [ "$dry" = 1 ]; then echo "changed in the dry run's copy (tree.dry-run.tgz: not for the checkout):"
    else echo "changed in the checkout (tree.tgz):"; fi
    sed 's/^/  /' "$scratch/changed.txt"
  fi
} | tee -a "$status"
tar czf "$out/logs.tgz" -C "$scratch" logs
say "done; slices left: $(python3 benchmarks/cuda_slices.py "${flags[@]}" pending | cut -d: -f1 | tr '\n' ' ')"
exit $failed
