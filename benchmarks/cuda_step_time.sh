#!/usr/bin/env bash
# The GPU step against fused AdamW and the 8-bit peers, in one run on a machine with one NVIDIA GPU:
#
#   bash benchmarks/cuda_step_time.sh OUT_DIR [SECONDS]
#
# from the repository root. In order: the CUDA graph step's tests on the GPU (real graphs: the same bits as
# the planned step over 50 steps with skips, a learning-rate schedule, a conversion and a resume; what
# invalidates a capture; the host's work per step), then benchmarks/step_time.py --device cuda on three
# shape sets (GPT-2 small's 124M parameters in 148 tensors, 20M in 33 ragged tensors, 1,000 tensors of
# 4,096), every format against fused and foreach AdamW, bitsandbytes' AdamW8bit, torchao's AdamW8bit and
# FlashOptim's FlashAdamW where they install (WHEELS=DIR: installed from the wheels in DIR first, where
# the machine lacks them). Each step_time run writes its docs section (docs/benchmarks/step-time.md,
# step_time_<set>_cuda), packed into OUT_DIR/results.tgz with the logs. SECONDS (default 540) bounds it.
# DEVICE=cpu: a dry run of the same parts on the CPU (step_time.py --quick: small, no docs written).
set -u
out=${1:?usage: bash benchmarks/cuda_step_time.sh OUT_DIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out/logs"
logs=$out/logs
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
start=$(date +%s)
left() { echo $((budget - ($(date +%s) - start))); }
part() {  # part NAME SECONDS COMMAND...: a part under a time limit, its log and exit status kept
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 20 ]; then echo "$name skipped: $limit s left" >> "$logs/status.txt"; return; fi
  echo "== $(date +%T) (+$(($(date +%s) - start)) s) $name (at most $limit s)"
  timeout "$limit" "$@" > "$logs/$name.log" 2>&1; echo "$name exit $?" >> "$logs/status.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$logs/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  >> "$logs/gpu.txt" 2>&1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" bitsandbytes torchao flashoptim > "$logs/peers.log" 2>&1
fi
python3 -c "
for name in ('bitsandbytes', 'torchao', 'flashoptim', 'triton'):
    try:
        module = __import__(name); print(name, getattr(module, '__version__', '?'))
    except Exception as err:
        print(name, 'unavailable:', type(err).__name__, err)" >> "$logs/gpu.txt" 2>&1
cat "$logs/gpu.txt"

part graph_tests 150 python3 -m pytest -q -p no:cacheprovider -rs tests/optim/test_graph_step.py \
  tests/integrations/test_cuda.py -k "graph or triton or fused or lone or many"
device=${DEVICE:-cuda}
step="python3 benchmarks/step_time.py --device $device --threads 1 --rounds 5 --steps 3 --warmup 3"
if [ "$device" = cpu ]; then step="$step --quick"; fi
part step_time_gpt2 $(( $(left) * 40 / 100 )) $step --shapes gpt2-small
part step_time_many $(( $(left) * 50 / 100 )) $step --shapes many
part step_time_ragged $(( $(left) - 15 )) $step --shapes ragged
cat "$logs/status.txt"
tail -n 3 "$logs/graph_tests.log"
tar czf "$out/results.tgz" docs/benchmarks/step-time.md "$logs" 2>/dev/null
