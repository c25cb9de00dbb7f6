#!/usr/bin/env bash
# One prepared device run on a lent GPU machine (no internet): installs the wheels carried in
# .gpu-wheels/, builds the C extension, runs bullet doctor (MPS off and on), the GPU-marked tests,
# the engine micro-benchmark and a served comparison within 8 minutes, and writes the report to
# $OUT/gpu/<gpu>-<date>/ (docs/gpu/<gpu>-<date>/ without $OUT). `--help` for the options;
# `--dry-run` lists every step with its budget and checks the carried wheels (any machine).
#
# From a session lent a GPU, after `bash scripts/gpu_wheels.sh` here, one call of the device tool:
#   run(command="BULLET_COMMIT=<git rev-parse HEAD> bash scripts/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=600)
# then `cp -r <files_at>/gpu/<gpu>-<date> docs/gpu/` and commit it. docs/gpu/README.md says more.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m artifact.gpu_check "$@"
