#!/usr/bin/env bash
# BAOC under Lightning's own DeepSpeedStrategy on one NVIDIA GPU, beside plain DeepSpeed AdamW:
#
#   bash benchmarks/cuda_deepspeed.sh OUT_DIR [SECONDS]
#
# from the repository root, with the deepspeed extra installed (DS_BUILD_OPS=0). The ZeRO client's and the
# callback's tests (their CPU ranks), then benchmarks/deepspeed_memory.py --accelerator cuda: a 40M GPT at
# ZeRO-2 and ZeRO-3, peak CUDA memory allocated and state bytes, written into docs/deepspeed.md (section
# deepspeed_memory_cuda) and OUT_DIR/deepspeed_memory.json; packed with the logs into OUT_DIR/results.tgz.
# SECONDS (default 540) bounds it.
set -u
out=${1:?usage: bash benchmarks/cuda_deepspeed.sh OUT_DIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out/logs"
logs=$out/logs
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DS_BUILD_OPS=0
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
part() {  # part NAME SECONDS COMMAND...: a part under a time limit, its log and exit status kept
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 20 ]; then echo "$name skipped: $limit s left" >> "$logs/status.txt"; return; fi
  echo "== $(date +%T) (+$(($(date +%s) - start)) s) $name (at most $limit s)"
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1; echo "$name exit $?" >> "$logs/status.txt"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$logs/gpu.txt" 2>&1
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, \
torch.cuda.get_device_name(0))" >> "$logs/gpu.txt" 2>&1
cat "$logs/gpu.txt"
part tests 200 python3 -m pytest -q -p no:cacheprovider -rs tests/optim/test_deepspeed.py \
  tests/integrations/test_callback_deepspeed.py
part memory $(( $(left) - 15 )) python3 benchmarks/deepspeed_memory.py --accelerator cuda --docs \
  --out "$out/deepspeed_memory.json"
cat "$logs/status.txt"
tar czf "$out/results.tgz" docs/deepspeed.md "$logs" "$out/deepspeed_memory.json" 2>/dev/null
