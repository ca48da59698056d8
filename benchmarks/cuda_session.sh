#!/usr/bin/env bash
# One prepared session on a lent GPU machine (docs/development.md, "The CUDA tier").
# Run from the repository root there, with the wheel built here in .whl/ (carried):
#   .venv/bin/pip wheel --no-deps . -w .whl                  (here, before the call)
#   BUDGET=540 bash benchmarks/cuda_session.sh direct tier table    (there)
# Parts, each under its own limit and all within BUDGET seconds: direct (benchmarks/direct_b.py:
# B through the engine against B calling the region's node, with and without CUDA graphs), tier
# (the CUDA test tier, most important tests first; TIER_PARTS="seconds|-k expression" lines
# choose), table (benchmarks/split_table.py), bench (fxsplit bench --device cuda). Everything goes
# to $OUT (default ./cuda-out), at most 8 files: gpu.txt, direct.log, cuda-direct-b.json, tier.log,
# table.log, cuda-split-table.json, bench.log, cuda-bench.json.
set -u
R=$(pwd)
OUT=${OUT:-$R/cuda-out}
END=$((SECONDS + ${BUDGET:-540}))
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$R"/.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$R PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
cd /tmp || exit 1  # the source tree's fxsplit/ must not shadow the installed wheel
python3 -c "import torch, fxsplit; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA', 'fxsplit', fxsplit.__file__)" | tee -a "$OUT/gpu.txt"
limit() {  # seconds for a part: its own limit, or what is left of the budget
  local left=$((END - SECONDS))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
tier() {  # most important first
  local k lim
  while IFS='|' read -r lim k; do
    [ $((END - SECONDS)) -lt 20 ] && { echo "budget spent: skipped -k '$k'" | tee -a "$OUT/tier.log"; continue; }
    echo "== -k '$k'" | tee -a "$OUT/tier.log"
    timeout "$(limit "$lim")" python3 -m pytest -p no:cacheprovider -p no:xdist -q -rfEs --durations=10 -m cuda \
      --show-capture=no --tb=short -W ignore::DeprecationWarning -W ignore::UserWarning \
      "$R/tests/test_cuda.py" -k "$k" 2>&1 | grep -v "^DEBUG" | tail -150 | tee -a "$OUT/tier.log"
  done <<PARTS
${TIER_PARTS:-200|llm_shapes and bf16
90|reduce_overhead
90|flex
180|not (llm_shapes and bf16) and not reduce_overhead and not flex}
PARTS
}
direct() {
  timeout "$(limit "${DIRECT_LIMIT:-120}")" python3 -m benchmarks.direct_b --device "${DEVICE:-cuda}" \
    --reps "${DIRECT_REPS:-30}" --out "$OUT/cuda-direct-b.json" 2>&1 | tail -40 | tee -a "$OUT/direct.log"
}
table() {
  timeout "$(limit "${TABLE_LIMIT:-300}")" python3 -m benchmarks.split_table --device "${DEVICE:-cuda}" \
    --configs "${TABLE_CONFIGS:-gpt-w256-4x128,gpt-w1024-4x512,llama-w1024-2x1024,gpt-w2048-4x1024}" \
    --reps "${TABLE_REPS:-20}" --out "$OUT/cuda-split-table.json" 2>&1 | tee -a "$OUT/table.log"
}
bench() {
  timeout "$(limit "${BENCH_LIMIT:-300}")" python3 -m fxsplit bench --device "${DEVICE:-cuda}" --compile-reps 1 \
    --reps 20 --no-chart --out "$OUT/cuda-bench.json" 2>&1 | tail -60 | tee -a "$OUT/bench.log"
}
for part in "$@"; do "$part"; done
echo "session done after $SECONDS s" | tee -a "$OUT/gpu.txt"
