#!/usr/bin/env bash
# Fetch, on a machine with internet, the source code a GPU run builds on the GPU machine (which has
# none): libsmctrl, into .gpu-sources/libsmctrl/ (ignored by git; carried to the machine beside
# .gpu-wheels/). The run's libsmctrl step compiles it there (artifact/gpu_check/libsmctrl.py).
#   bash scripts/gpu_sources.sh [DIR]                 # DIR defaults to .gpu-sources
#   LIBSMCTRL_REF=<commit or tag> bash scripts/gpu_sources.sh
#   LIBSMCTRL_SOURCE=/path/to/a/copy bash scripts/gpu_sources.sh   # copy a local checkout instead
# The source is build input, never committed here; its licence is the one in the fetched copy (the
# build step reports it). The copy is stamped in DIR/libsmctrl.source with where it came from.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/.gpu-sources}
url=${LIBSMCTRL_URL:-https://github.com/JoshuaJB/libsmctrl}
ref=${LIBSMCTRL_REF:-}
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x "$root/.venv/bin/python" ]; then py=$root/.venv/bin/python
else py=python3; fi

mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -n "${LIBSMCTRL_SOURCE:-}" ]; then
  cp -r "$LIBSMCTRL_SOURCE" "$tmp/libsmctrl"
  origin="$LIBSMCTRL_SOURCE"
  commit=$(git -C "$LIBSMCTRL_SOURCE" rev-parse HEAD 2>/dev/null || echo unknown)
else
  git clone --quiet "$url" "$tmp/libsmctrl"
  [ -z "$ref" ] || git -C "$tmp/libsmctrl" checkout --quiet "$ref"
  origin="$url"
  commit=$(git -C "$tmp/libsmctrl" rev-parse HEAD)
fi
rm -rf "$tmp/libsmctrl/.git"  # plain files: the copy travels as a folder, not a nested repository
rm -rf "$dir/libsmctrl"
mv "$tmp/libsmctrl" "$dir/libsmctrl"
echo "libsmctrl $origin commit $commit, fetched $(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$dir/libsmctrl.source"
echo "[gpu_sources] $(cat "$dir/libsmctrl.source") -> $dir/libsmctrl"
# what the GPU machine will build, and whether anything is missing for it
cd "$root"
"$py" -m artifact.gpu_check.libsmctrl --dry-run --source "$dir/libsmctrl" >/dev/null || {
  echo "[gpu_sources] the build plan has problems: $py -m artifact.gpu_check.libsmctrl --dry-run --source $dir/libsmctrl" >&2
  exit 1
}
