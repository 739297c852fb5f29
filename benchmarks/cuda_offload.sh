#!/usr/bin/env bash
# The interleaved offload schedule measured on one NVIDIA GPU, with its logs:
#
#   bash benchmarks/cuda_offload.sh OUT_DIR [SECONDS]
#
# from the repository root, with lightning_baoc importable (installed, or this checkout on PYTHONPATH). Runs
# the schedule's CUDA tests, then benchmarks/offload_schedule.py: the optimizer step of 1.2B offloaded
# parameters (host-only, interleaved, all on the GPU, and fp32 states on the GPU) and a Lightning GPT with
# every state offloaded, each schedule's iteration time, peak GPU memory and the model's prediction beside
# the measured update. The CPU's AdamW runs on every core
# (no OMP_NUM_THREADS=1 here: the host path is the CPU's work). SECONDS (default 540) bounds the run; the results
# (OUT_DIR/offload_schedule.json, .md) and the logs (OUT_DIR/tests.log, offload_schedule.log) stay in OUT_DIR.
set -u
out=${1:?usage: bash benchmarks/cuda_offload.sh OUT_DIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
start=$(date +%s)
# first the schedule's CUDA tests (streams, events, pinned buffers, the worker thread of updates in backward)
timeout 120 python -m pytest -q -p no:cacheprovider tests/optim/test_offload_schedule.py -k cuda \
  "tests/integrations/test_cuda.py::test_every_format_steps_on_cuda_as_on_the_cpu[offload]" > "$out/tests.log" 2>&1
echo "tests exit $?" | tee -a "$out/gpu.txt"; tail -n 3 "$out/tests.log"
left=$((budget - ($(date +%s) - start)))
timeout "$left" python benchmarks/offload_schedule.py --out "$out" > "$out/offload_schedule.log" 2>&1
echo "offload_schedule exit $?" | tee -a "$out/gpu.txt"
tail -n 30 "$out/offload_schedule.log"
