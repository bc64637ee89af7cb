#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine (device tool: `run` with `carry: [".whl"]`, after
# `.ci/device_wheels.sh` here): installs the carried wheels, then runs the test files whose workers
# train on the GPU there (`train.device: auto`), one file at a time under its own time limit, so that
# each file's failures and tracebacks are written before the next starts. Logs go to $OUT.
# Usage (there): bash .ci/device_check.sh [SECONDS_PER_FILE] [TEST_FILE...]
set -uo pipefail
PER_FILE=${1:-120}
shift || true
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=(tests/test_device.py tests/test_island.py tests/test_hierarchy.py
  tests/test_hf_pipeline.py tests/test_swarm_training.py tests/test_islands.py tests/test_pipeline_runtime.py)
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, hivemind, decentral.swarm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'hivemind', hivemind.__version__)" || exit 3
nvidia-smi -L
status=0
for f in "${FILES[@]}"; do
  name=$(basename "$f" .py)
  timeout "$PER_FILE" python3 -m pytest -p no:cacheprovider -q -rfEs --tb=short "$f" > "$OUT/$name.log" 2>&1
  code=$?
  [ "$code" -eq 0 ] || status=1
  echo "== $f: exit $code; $(tail -1 "$OUT/$name.log")"
  grep -E "^(FAILED|ERROR) " "$OUT/$name.log"
done
exit "$status"
