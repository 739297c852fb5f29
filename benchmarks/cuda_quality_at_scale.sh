#!/usr/bin/env bash
# The quality-at-scale runs on one NVIDIA GPU, a slice at a time (benchmarks/quality_at_scale.py).
#
#   bash benchmarks/cuda_quality_at_scale.sh OUT_DIR [SECONDS]
#
# from the repository root. First the peers this machine lacks are installed from wheels (bitsandbytes,
# torchao, flashoptim; a peer that does not install stays a row that says so), and one step of each size is
# timed (logged: how many runs a slice holds);
# then the runs of the plan not in benchmarks/runs/quality_at_scale/ yet, in the plan's order, each written
# when it ends, stopping before one that would not finish in SECONDS (default 540) less what the set-up took.
# The runs, the table (docs section quality_at_scale) and the loss curves are packed into OUT_DIR/results.tgz, the logs into
# OUT_DIR/logs.tgz. A later call resumes where this one stopped.
set -u
out=${1:?usage: bash benchmarks/cuda_quality_at_scale.sh OUT_DIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out/logs"
logs=$out/logs
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$logs/gpu.txt" 2>&1
for peer in bitsandbytes torchao flashoptim; do
  python3 -c "import $peer" 2>/dev/null || timeout 120 python3 -m pip install -q --only-binary=:all: "$peer" >> "$logs/peers.log" 2>&1
  python3 -c "import $peer; print('$peer', getattr($peer, '__version__', '?'))" >> "$logs/peers.log" 2>&1 || echo "$peer: not installed" >> "$logs/peers.log"
done
timeout 120 python3 benchmarks/quality_at_scale.py --device cuda --time-steps > "$logs/step_times.log" 2>&1
left=$((budget - ($(date +%s) - start)))
timeout "$left" python3 benchmarks/quality_at_scale.py --device cuda --max-seconds $((left - 30)) > "$logs/quality_at_scale.log" 2>&1
echo "quality_at_scale exit $?" >> "$logs/status.txt"
python3 benchmarks/quality_at_scale.py --report-only --docs > "$logs/report.log" 2>&1
tar czf "$out/results.tgz" benchmarks/runs/quality_at_scale docs/benchmarks/quality-at-scale*.md docs/benchmarks/quality-at-scale-*.png 2>/dev/null
tar czf "$out/logs.tgz" -C "$out" logs
cat "$logs/status.txt" "$logs/peers.log" "$logs/step_times.log"; tail -5 "$logs/quality_at_scale.log"
