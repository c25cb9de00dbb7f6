#!/usr/bin/env bash
# One prepared run on a GPU machine, which needs no internet: installs the wheels copied into
# .gpu-wheels/, builds the C extension and runs one plan within 8 minutes — serve (the served
# comparison at steady state), mechanism (libsmctrl, bullet doctor with MPS off and on, the SM probe,
# the GPU-marked tests) or engine (the engine micro-benchmark and the profile); `--plan stalest`, the
# default, picks the one whose last run (docs/gpu/plans.json) is oldest. It writes the report to
# $OUT/gpu/<gpu>-<date>-<plan>/ (docs/gpu/... without $OUT) and the record beside it. `--help` for the
# options; `--dry-run` lists the plan's steps with their budget and checks the wheels (any machine).
#
# On a machine with internet, `bash scripts/gpu_wheels.sh` fetches the wheels; copy the checkout with
# .gpu-wheels/ to the GPU machine and run there (allow ~10 minutes):
#   BULLET_COMMIT=<git rev-parse HEAD> OUT=<dir> bash scripts/gpu_check.sh --plan stalest
# then copy <dir>/gpu/* (the report folder and plans.json) into docs/gpu/ and commit them.
# docs/gpu/README.md says more.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3; fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m artifact.gpu_check "$@"
