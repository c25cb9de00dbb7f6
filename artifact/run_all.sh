#!/usr/bin/env bash
# The artifact evaluation: every benchmark, comparison and figure of docs/results.md, as resumable
# steps, and one report with every table and figure and the command that produced it.
#
#   bash artifact/run_all.sh            # full reference configuration (about 1.75 hours on 2 cores)
#   bash artifact/run_all.sh --quick    # every step on a reduced workload (<= 20 minutes on 2 cores)
#   bash artifact/run_all.sh --smoke    # seconds: the fast steps on a minimal workload, the rest skipped
#   options: --force (re-run finished steps)  --run NAME  --only STEP ...  --list
#
# Output: artifact/results/<run>/report.md (run = full | quick | smoke unless --run is given).
# Needs the test extra: bash scripts/install.sh --artifact (the same as --test).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${BULLET_PYTHON:-}" ]; then
  py=$BULLET_PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  py=$VIRTUAL_ENV/bin/python
elif [ -x "$root/.venv/bin/python" ]; then
  py=$root/.venv/bin/python
else
  py=python3
fi
cd "$root"
exec "$py" -m artifact.evaluation "$@"
