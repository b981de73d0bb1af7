#!/usr/bin/env bash
# The first machine with a GPU runs this: every check that needs CUDA, in under 10 minutes.
#
#   bash bench/gpu_first_run.sh            # writes gpu-first-run/ (or $OUT)
#
# 1. `ebrl bench gpu-split`: one stream, priority streams and green-context SM splits, with a
#    policy forward and a CNN training step on two threads (about 2 minutes);
# 2. bench/gpu_pi0.py: a published-size π0 and π0.5 (random weights, nothing downloaded) in
#    bf16: act latency at batch 1, 8 and 32, a LoRA PPO update, a publication's size;
# 3. bench/emulator_vs_gpu.py: those latencies against the emulated device's model (pi0-h200,
#    ebrl.emulated), per batch size: how far the emulation is from this card;
# 4. bench/paper_regime_gpu.py: the paper's regime on this GPU (a published-size π0 beside
#    ManiSkill3 on the CPU cores, async and sync) next to its emulated twin on a profile
#    calibrated on this card: a check of the emulated device's scheduling model.
#
# Without CUDA it says so and exits 0. Each step has its own deadline; a step that fails is
# reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-gpu-first-run}
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_first_run: CUDA is not available here (torch.cuda.is_available() is False): skipped"
    exit 0
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))' \
    | tee "$OUT/torch.txt"

status=0
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0))s (log: $OUT/$name.log)"
    tail -n 15 "$OUT/$name.log"
    [ $rc -eq 0 ] || status=1
}

step gpu-split 150 "$PY" -m ebrl bench gpu-split --out "$OUT"
step gpu-pi0 240 "$PY" bench/gpu_pi0.py --out "$OUT/gpu_pi0.json"
step emulator-vs-gpu 30 "$PY" bench/emulator_vs_gpu.py "$OUT/gpu_pi0.json" --out "$OUT/emulator_vs_gpu.json"
step paper-regime-gpu 180 "$PY" bench/paper_regime_gpu.py --out "$OUT/paper_regime_gpu.json"
echo "gpu_first_run: done, results in $OUT/ (exit $status)"
exit $status
