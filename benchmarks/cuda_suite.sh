#!/usr/bin/env bash
# The CUDA tests and the GPU measurements of the docs, in one run on a machine with one NVIDIA GPU.
#
#   bash benchmarks/cuda_suite.sh OUT_DIR [SECONDS]
#
# from the repository root, with lightning_baoc importable (installed, or this checkout on
# PYTHONPATH). In order:
#   1. alone on the GPU (timings): where the step's time goes (the host's Python against the kernels),
#      the optimizer step times against fused AdamW, with fp32 and with bf16 weights;
#   2. side by side (none of them is a timing): the CUDA tests, then with the time left the peak
#      memory of Lightning runs with BAOC; the total memory of whole runs (peak CUDA allocated, read
#      in each run's own process), with each run's CUDA memory history (what is live at the peak);
#      and the quality runs (one process per workload, recipe and seed; each run cached as JSON under
#      benchmarks/runs/*_cuda, so a run already in the checkout is not trained again and a second call
#      resumes).
# The docs sections they write (`*_cuda`), the runs' caches and the memory histories are packed into
# OUT_DIR/results.tgz, the logs into OUT_DIR/logs.tgz. SECONDS (default 480) bounds the whole run;
# parts cut off leave what they cached. Python's fault handler is on: a crash prints every thread's stack.
set -u
out=${1:?usage: bash benchmarks/cuda_suite.sh OUT_DIR [SECONDS]}
budget=${2:-480}
mkdir -p "$out" "$out/logs"
logs=$out/logs
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
say() { echo "== $(date +%T) (+$(($(date +%s) - start)) s) $*"; }
part() {  # part NAME SECONDS COMMAND...: run a part under a time limit, its log and exit status kept
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 20 ]; then echo "$name skipped: $limit s left" >> "$logs/status.txt"; return; fi
  say "$name (at most $limit s)"
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1; echo "$name exit $?" >> "$logs/status.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$logs/gpu.txt" 2>&1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'lightning', lightning.__version__)" >> "$logs/gpu.txt" 2>&1
cat "$logs/gpu.txt"

part cuda_profile 60 python3 benchmarks/cuda_profile.py
step="python3 benchmarks/step_time.py --device cuda --threads 1 --rounds 5 --steps 2 --warmup 2"
part step_time $(( $(left) * 30 / 100 )) $step
part step_time_bf16 $(( $(left) * 18 / 100 )) $step --bf16-weights

say "side by side: CUDA tests, then peak memory; total memory; quality"
rest=$(( $(left) - 30 ))
part total_memory $rest python3 benchmarks/total_memory.py --device cuda --docs --memory-history memory_history &
(part tests $rest python3 -m pytest -q -p no:cacheprovider -rs tests/integrations/test_cuda.py \
   tests/optim/test_conversion_memory.py tests/kernels/test_step_decisions.py tests/costs/test_instruments.py \
   tests/costs/test_calibration.py tests/report/test_memory.py tests/optim/test_graph_step.py \
   "tests/benchmarks/test_peak_memory.py::test_the_peak_over_the_steady_state_is_within_adamws_own_plus_a_third_of_a_byte" \
   "tests/benchmarks/test_peak_memory.py::test_the_planned_peak_is_the_measured_allocated_peak_within_5_percent"
 part peak_excess $(( $(left) - 25 )) python3 benchmarks/peak_memory.py --excess --accelerator cuda --docs
 part peak_planned $(( $(left) - 25 )) python3 benchmarks/peak_memory.py --planned --accelerator cuda --docs
 part peak_memory $(( $(left) - 25 )) python3 benchmarks/peak_memory.py --accelerator cuda --layers 40 --docs) &
jobs_file=$logs/quality_jobs.txt
bf16_rows="bf16mixed_adamw bf16w_adamw bf16w_int8 bf16w_int8_ecc8 bf16w_baoc_0.15 bf16w_baoc_0.15_defaults"
sgd_lion_rows="sgd_fp32 sgd_bf16w_int8_ecc8 sgd_bf16w_int8 lion_fp32 lion_bf16w_int8_ecc8 lion_bf16w_int8"
: > "$jobs_file"
for seed in 0 1 2; do
  for recipe in realistic stress; do
    for w in char_gpt ddpm_digits; do
      echo "bf16_weights.py --accelerator cuda --workloads $w --recipes $recipe --seeds $seed --rows $bf16_rows" >> "$jobs_file"
    done
    echo "sgd_lion.py --accelerator cuda --recipes $recipe --seeds $seed --rows $sgd_lion_rows" >> "$jobs_file"
  done
done
(timeout $rest xargs -P 14 -I{} sh -c 'python3 benchmarks/{} > "'"$logs"'/q_$(echo "{}" | tr -c "a-z0-9" _ | cut -c1-90).log" 2>&1' \
   < "$jobs_file"; echo "quality exit $?" >> "$logs/status.txt") &
wait

say "tables from the cached runs"
timeout 60 python3 benchmarks/bf16_weights.py --accelerator cuda --report-only --docs --rows $bf16_rows \
  > "$logs/bf16_weights_table.log" 2>&1
timeout 60 python3 benchmarks/sgd_lion.py --accelerator cuda --report-only --docs --rows $sgd_lion_rows \
  > "$logs/sgd_lion_table.log" 2>&1
cat "$logs/status.txt"
tail -n 3 "$logs/tests.log"
tar czf "$out/results.tgz" docs/benchmarks benchmarks/runs/*_cuda memory_history 2>/dev/null
tar czf "$out/logs.tgz" -C "$out" logs
cp "$logs/status.txt" "$out/status.txt"
say "done"
