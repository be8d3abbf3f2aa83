#!/usr/bin/env bash
# Install llama-cpp-python (pinned) into a virtual environment, for the backend "llama.cpp" and tests/test_llama_cpp.py.
#
#   bash .ci/install_llama_cpp.sh [VENV]      (default VENV: .venv next to this repo's root, which already has ssr)
#
# The wheel is built from source with a portable CPU configuration:
#   -DGGML_NATIVE=OFF  a native (-march=native) build of 0.3.36 crashed on the first llama_decode on the AVX-512/AMX
#                      dev CPU; a non-native build does not;
#   -DGGML_AVX2=ON     keeps the fast x86 kernels every current x86-64 CPU has;
#   -DGGML_AVX512=OFF  the AVX-512 code paths are the ones that crashed.
# Building takes about 8 minutes on 2 cores, so the built wheel is kept in a wheelhouse keyed by version and flags
# (pip's own wheel cache does not key on CMAKE_ARGS, so a wheel built with other flags could come back from it);
# a second run installs that wheel in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
VERSION=0.3.36
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
KEY=$(printf '%s' "$VERSION $FLAGS" | sha256sum | cut -c1-12)
WHEELHOUSE="${SSR_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/ssr/wheels}/llama-cpp-python-$VERSION-$KEY"
start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! ls "$WHEELHOUSE"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  mkdir -p "$WHEELHOUSE"
  echo "install_llama_cpp: building llama-cpp-python $VERSION ($FLAGS); about 8 minutes on 2 cores"
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$VENV/bin/python" -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$VERSION" -w "$WHEELHOUSE"
fi
"$VENV/bin/python" -m pip install --quiet "$WHEELHOUSE"/llama_cpp_python-"$VERSION"-*.whl
"$VENV/bin/python" - <<'PY'
import llama_cpp
print("llama-cpp-python", llama_cpp.__version__, "|", llama_cpp.llama_print_system_info().decode().strip())
PY
echo "install_llama_cpp: $(( $(date +%s) - start )) s into $VENV (wheel: $WHEELHOUSE)"
