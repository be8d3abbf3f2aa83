#!/usr/bin/env bash
# Install SSR into a virtual environment (default .venv): the engine, the LangChain and LlamaIndex adapters and the
# benchmark harness, editable, then llama.cpp built for this CPU (docs/install.md).
#
#   bash install.sh [VENV]        the README's first command and CI's install stage run this
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV="${1:-.venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
step() { echo "install: $*"; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
step "pip, PyTorch (CPU build), the engine, adapters and harness"
"$VENV/bin/pip" install -q --upgrade pip uv
"$VENV/bin/pip" install -q torch==2.13.0  # the CPU build (an unpinned torch pulls a multi-GB CUDA build)
# the rest through uv: the packages pip would resolve, torch kept as installed above, in seconds
uv() { "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$@"; }
uv -e ".[all]" -e "./integrations/langchain[test]" -e "./integrations/llamaindex[test]" -e ./benchmarks
uv --no-deps bfcl-eval  # BFCL's data (its own dependencies are not needed)
step "llama.cpp (llama-cpp-python, built for this CPU)"
bash scripts/install_llama_cpp.sh "$VENV"
"$VENV/bin/ssr" --help > /dev/null
step "done: $VENV"
