#!/usr/bin/env bash
# The GPU check, prepared: run on a machine with torch (CUDA), CuPy, pyarrow and xxhash, but
# no Ray, NIXL or FastAPI, and no network. Installs nothing. Under ten minutes.
#
#   OUT=/some/dir tests/gpu/run.sh      # tables land in $OUT (default: ./gpu-out)
#
# The repository is not installed there, and cmx.policies, cmx.actors, cmx.api, cmx.deploy
# live at its top (an install maps them under cmx): a scratch site-packages gives the same
# tree with links, so `import cmx.<anything>` resolves as it does installed.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
cp -r "$ROOT/cmx" "$SITE/cmx"
for sub in actors policies api deploy; do
  [ -d "$ROOT/$sub" ] && ln -s "$ROOT/$sub" "$SITE/cmx/$sub"
done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" CMX_GPU_OUT="$OUT"
PY="${PYTHON:-python3}"

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
  "$PY" -c "import cupy; print('cupy', cupy.__version__)" 2>&1 || echo "cupy: absent"
} | tee "$OUT/environment.txt"

cd "$ROOT"
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 540 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/pytest.txt"
  rc=${PIPESTATUS[0]}
else
  timeout 540 "$PY" tests/gpu/standalone.py 2>&1 | tee "$OUT/pytest.txt"
  rc=${PIPESTATUS[0]}
fi
echo "exit $rc" | tee -a "$OUT/pytest.txt"
for t in gpu_bandwidth gpu_overlap; do
  [ -f "$OUT/$t.md" ] && { echo; echo "## $t"; cat "$OUT/$t.md"; }
done
exit "$rc"
