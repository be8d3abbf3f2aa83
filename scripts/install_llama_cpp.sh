#!/usr/bin/env bash
# Build and install llama-cpp-python (pinned) into a virtual environment: SSR's default CPU engine.
#
#   bash scripts/install_llama_cpp.sh [VENV] [--tools]     (default VENV: .venv at the repository root)
#
# --tools also builds llama.cpp's own `llama-server` and `llama-bench` from the same source and flags (the peers of
# `ssr bench`: benchmarks/ssr_bench/llama_server.py), kept next to the wheel.
#
# Kernels: the build targets the CPU it runs on, feature by feature, from /proc/cpuinfo: AVX2/FMA/F16C always (every
# current x86-64 CPU), and AVX-512 (F, VBMI, VNNI, BF16) and AVX-VNNI where the CPU has them. AMX stays off: a
# `-march=native` build of 0.3.36 crashed on the first llama_decode of an AVX-512/AMX Xeon. After installing, a
# decode runs in a child process; if it dies, the portable build (AVX2, no AVX-512) replaces it.
# SSR_LLAMA_BUILD=portable forces the portable build. docs/backends/llama-cpp.md measures the two.
#
# Building takes about 8 minutes on 2 cores (10 with --tools), so the wheel is kept in a wheelhouse keyed by the
# version and the flags (pip's own wheel cache does not key on CMAKE_ARGS); a second run installs it in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
TOOLS=0
for arg in "$@"; do
  case "$arg" in
    --tools) TOOLS=1 ;;
    *) VENV="$arg" ;;
  esac
done
VERSION=0.3.36
COMMON="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
PORTABLE="-DGGML_AVX512=OFF"

cpu_flags() {  # the ggml options this CPU supports beyond AVX2 (x86-64 Linux; empty elsewhere)
  local have
  have=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  local out=""
  if [[ $have == *" avx512f "* && $have == *" avx512bw "* && $have == *" avx512vl "* && $have == *" avx512dq "* ]]; then
    out="-DGGML_AVX512=ON"
    [[ $have == *" avx512vbmi "* ]] && out="$out -DGGML_AVX512_VBMI=ON"
    [[ $have == *" avx512_vnni "* ]] && out="$out -DGGML_AVX512_VNNI=ON"
    [[ $have == *" avx512_bf16 "* ]] && out="$out -DGGML_AVX512_BF16=ON"
  else
    out="$PORTABLE"
  fi
  [[ $have == *" avx_vnni "* ]] && out="$out -DGGML_AVX_VNNI=ON"
  echo "$out"
}

wheelhouse() {  # the folder for the wheel built with flags "$1"
  local key
  key=$(printf '%s' "$VERSION $1" | sha256sum | cut -c1-12)
  echo "${SSR_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/ssr/wheels}/llama-cpp-python-$VERSION-$key"
}

build() {  # build "$1" (flags) into its wheelhouse unless the wheel (and, with --tools, the tools) are there
  local flags=$1 house
  house=$(wheelhouse "$flags")
  if ls "$house"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1 && { [ "$TOOLS" = 0 ] || [ -x "$house/bin/llama-server" ]; }; then
    return
  fi
  mkdir -p "$house"
  local extra="-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" targets=() tree
  tree=$(mktemp -d)
  if [ "$TOOLS" = 1 ]; then  # the two tools only (not every tool of llama.cpp), not installed into the wheel
    extra="-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_TOOLS_INSTALL=OFF"
    for t in llama ggml llama-server llama-bench; do targets+=("--config-settings=build.targets=$t"); done
  fi
  echo "install_llama_cpp: building llama-cpp-python $VERSION ($(echo $flags)); about 8 minutes on 2 cores"
  # shellcheck disable=SC2086
  CMAKE_ARGS="$(echo $flags $extra)" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$VENV/bin/python" -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
    --config-settings=build-dir="$tree" "${targets[@]}" "llama-cpp-python==$VERSION" -w "$house"
  if [ "$TOOLS" = 1 ]; then  # the tools and every shared library they load, run with LD_LIBRARY_PATH=$house/bin
    mkdir -p "$house/bin"
    find "$tree" \( -type f -o -type l \) \( -name llama-server -o -name llama-bench -o -name '*.so*' \) \
      -exec cp -P {} "$house/bin/" \;
  fi
  rm -rf "$tree"
}

install_wheel() {  # the wheel built with flags "$1" (its dependencies from the index, the wheel itself replaced)
  "$VENV/bin/python" -m pip uninstall --quiet --yes llama-cpp-python >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install --quiet "$(wheelhouse "$1")"/llama_cpp_python-"$VERSION"-*.whl
}

smoke() {  # a decode of the installed build, in a child process (a crashing kernel kills the child, not us)
  "$VENV/bin/python" - <<'PY'
import llama_cpp as ll
ll.llama_backend_init()
print("llama-cpp-python", ll.__version__, "|", ll.llama_print_system_info().decode().strip())
PY
  "$VENV/bin/python" -c "from ssr.backends.llama_cpp import smoke_test; smoke_test()"
}

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if [ "${SSR_LLAMA_BUILD:-native}" = portable ]; then FLAGS="$COMMON $PORTABLE"; else FLAGS="$COMMON $(cpu_flags)"; fi
build "$FLAGS"
install_wheel "$FLAGS"
if ! smoke && [ "$FLAGS" != "$COMMON $PORTABLE" ]; then
  echo "install_llama_cpp: the build for this CPU failed its first decode; installing the portable build"
  FLAGS="$COMMON $PORTABLE"
  build "$FLAGS"
  install_wheel "$FLAGS"
  smoke
fi
echo "install_llama_cpp: $(( $(date +%s) - start )) s into $VENV (wheel: $(wheelhouse "$FLAGS"))"
