#!/usr/bin/env bash
# One prepared run on a GPU machine, which needs no internet: installs the wheels copied into
# .gpu-wheels/, builds the C extension, runs bullet doctor (MPS off and on), the GPU-marked tests,
# the engine micro-benchmark and a served comparison within 8 minutes, and writes the report to
# $OUT/gpu/<gpu>-<date>/ (docs/gpu/<gpu>-<date>/ without $OUT). `--help` for the options;
# `--dry-run` lists every step with its budget and checks the wheels (any machine).
#
# On a machine with internet, `bash scripts/gpu_wheels.sh` fetches the wheels; copy the checkout with
# .gpu-wheels/ to the GPU machine and run there (allow ~10 minutes):
#   BULLET_COMMIT=<git rev-parse HEAD> bash scripts/gpu_check.sh
# then copy <gpu>/<date> back into docs/gpu/ and commit it. docs/gpu/README.md says more.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m artifact.gpu_check "$@"
