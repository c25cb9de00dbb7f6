#!/usr/bin/env bash
# Start a Bullet server: `bash scripts/launch.sh [bullet launch flags...]`.
#
# On a CPU (the default `--device cpu`, or no NVIDIA GPU) this is `bullet launch "$@"`.
# Serving on an NVIDIA GPU (`--device cuda|auto` with a GPU present) it first
#   1. makes sure the MPS control daemon runs when the policy uses two worker processes (every policy
#      but chunked:<n> and sglang:<n>): without MPS two CUDA processes time-slice the GPU instead of
#      sharing its SMs;
#   2. runs `bullet doctor` (its --quick mode when it has one) and stops if a check FAILs, because the
#      GPU path has not yet been verified on hardware;
# and then execs `bullet launch "$@"`.
#
# Environment: BULLET_BIN (the bullet executable; default: the project's .venv, the active venv, or
# PATH), BULLET_LAUNCH_NO_MPS=1 (never touch MPS), BULLET_LAUNCH_SKIP_DOCTOR=1, BULLET_LAUNCH_FORCE=1
# (launch even if the doctor reports a failure).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

if [ -n "${BULLET_BIN:-}" ]; then
  bullet=$BULLET_BIN
elif [ -x "$root/.venv/bin/bullet" ]; then
  bullet=$root/.venv/bin/bullet
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/bullet" ]; then
  bullet=$VIRTUAL_ENV/bin/bullet
else
  bullet=$(command -v bullet || true)
  [ -n "$bullet" ] || { echo "[launch] bullet is not installed: run bash scripts/install.sh" >&2; exit 2; }
fi

# the two flags that decide what is needed, as `bullet launch` will read them (last one wins)
device=cpu
policy=static
prev=""
for arg in "$@"; do
  case "$prev" in
    --device) device=$arg ;;
    --policy) policy=$arg ;;
  esac
  case "$arg" in
    --device=*) device=${arg#--device=} ;;
    --policy=*) policy=${arg#--policy=} ;;
  esac
  prev=$arg
done

gpu_present() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }

if [ "$device" = cpu ] || ! gpu_present; then
  if [ "$device" = cpu ] && gpu_present; then
    echo "[launch] an NVIDIA GPU is present but --device is cpu: serving on the CPU (pass --device cuda to use the GPU)" >&2
  fi
  exec "$bullet" launch "$@"
fi

echo "[launch] NVIDIA GPU: $(nvidia-smi -L | head -n 1)" >&2
case "$policy" in
  chunked:*|sglang:*) needs_mps=0 ;;  # one worker process (bullet.policies.factory.ONE_PROCESS_POLICIES)
  *) needs_mps=1 ;;
esac
if [ "$needs_mps" = 1 ] && [ "${BULLET_LAUNCH_NO_MPS:-0}" != 1 ]; then
  if pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "[launch] MPS control daemon is running" >&2
  elif command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "[launch] starting the MPS control daemon (nvidia-cuda-mps-control -d)" >&2
    if ! nvidia-cuda-mps-control -d; then
      echo "[launch] could not start MPS: start it as the GPU's owner (or set BULLET_LAUNCH_NO_MPS=1 to serve without it)" >&2
      exit 1
    fi
  else
    echo "[launch] policy '$policy' runs two worker processes, which need MPS, but nvidia-cuda-mps-control is not installed" >&2
    exit 1
  fi
fi

if [ "${BULLET_LAUNCH_SKIP_DOCTOR:-0}" != 1 ]; then
  doctor=(doctor)
  if "$bullet" doctor --help 2>/dev/null | grep -q -- '--quick'; then
    doctor+=(--quick)
  fi
  echo "[launch] bullet ${doctor[*]}" >&2
  if ! "$bullet" "${doctor[@]}" >&2; then
    if [ "${BULLET_LAUNCH_FORCE:-0}" = 1 ]; then
      echo "[launch] the doctor reported a failure; launching anyway (BULLET_LAUNCH_FORCE=1)" >&2
    else
      echo "[launch] the doctor reported a failure (above): fix it, or set BULLET_LAUNCH_FORCE=1 to launch anyway" >&2
      exit 1
    fi
  fi
fi
exec "$bullet" launch "$@"
