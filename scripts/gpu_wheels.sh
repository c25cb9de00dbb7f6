#!/usr/bin/env bash
# Download, on a machine with internet, the Python 3.12 manylinux x86_64 wheels a GPU machine's image
# lacks, into .gpu-wheels/ (ignored by git; carried to the machine: `carry: [".gpu-wheels"]`).
#   bash scripts/gpu_wheels.sh [DIR]
# The pins are artifact/gpu_check/wheels.txt, the list scripts/gpu_check.sh installs from (one source).
# Wheels already there are kept; a wheel of a pinned package at another version is removed (two
# versions of one package would stop the install there). Also stamps DIR/SOURCE with this checkout's
# commit, which the GPU report quotes when the machine has no .git.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.gpu-wheels}
pins_file=$root/artifact/gpu_check/wheels.txt
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3; fi

mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$pins_file" | grep -v '^$')
mkdir -p "$dir"
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g'; }
for pin in "${pins[@]}"; do
  name=${pin%%==*}; version=${pin##*==}
  for whl in "$dir"/*.whl; do
    [ -e "$whl" ] || continue
    base=$(basename "$whl"); wname=${base%%-*}; rest=${base#*-}; wver=${rest%%-*}
    if [ "$(norm "$wname")" = "$(norm "$name")" ] && [ "$wver" != "$version" ]; then
      echo "[gpu_wheels] removing $base (pinned: $pin)"; rm -f "$whl"
    fi
  done
done

# pip matches each manylinux tag exactly: name the ones these packages publish
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
echo "[gpu_wheels] ${#pins[@]} pins -> $dir"
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dir" "${pins[@]}" 2>&1 | grep -v "is ignored" || true

commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain 2>/dev/null | { grep -v '^??' || true; } | wc -l | tr -d ' ')
echo "commit $commit (+$dirty uncommitted changes), wheels fetched $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$dir/SOURCE"
# the check gpu_check --dry-run runs there: every pin present
cd "$root"
"$py" - "$dir" <<'PY'
import sys
from pathlib import Path
from artifact.gpu_check.wheels import missing, total_bytes
folder = Path(sys.argv[1])
gone = missing(folder)
print(f"[gpu_wheels] {folder}: {total_bytes(folder) / 2**20:.1f} MiB of pinned wheels")
if gone:
    print("[gpu_wheels] missing: " + " ".join(map(str, gone)), file=sys.stderr)
    sys.exit(1)
PY
