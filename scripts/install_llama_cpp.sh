#!/usr/bin/env bash
# Build and install llama-cpp-python (pinned) into a virtual environment: SSR's default CPU engine.
#
#   bash scripts/install_llama_cpp.sh [VENV] [--tools]     (default VENV: .venv at the repository root)
#   bash scripts/install_llama_cpp.sh --print-flags        the builds it would try here, best first, one a line
#
# --tools also builds llama.cpp's own `llama-server` and `llama-bench` from the same source and flags (the peers of
# `ssr bench`: benchmarks/ssr_bench/llama_server.py), kept next to the wheel.
#
# The build targets this CPU's features (/proc/cpuinfo), from the sdist with SSR's patches (scripts/llama_cpp/).
# A decode in a child process checks it; the next candidate build replaces one that fails. SSR_LLAMA_BUILD=no-amx
# or =portable asks for those builds. The wheel is kept, keyed by version, patches and flags, so a second run takes
# seconds. What each build and patch is: docs/backends/llama-cpp.md#install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
TOOLS=0
PRINT_FLAGS=0
for arg in "$@"; do
  case "$arg" in
    --tools) TOOLS=1 ;;
    --print-flags) PRINT_FLAGS=1 ;;
    *) VENV="$arg" ;;
  esac
done
VERSION=0.3.36
COMMON="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
NO_AMX="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
PORTABLE="-DGGML_AVX512=OFF $NO_AMX"

cpu_flags() {  # the ggml options this CPU supports beyond AVX2 (x86-64 Linux; empty elsewhere)
  local have
  have=" $(grep -m1 '^flags' "${SSR_CPUINFO:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2) "  # SSR_CPUINFO: tests
  local out=""
  if [[ $have == *" avx512f "* && $have == *" avx512bw "* && $have == *" avx512vl "* && $have == *" avx512dq "* ]]; then
    out="-DGGML_AVX512=ON"
    [[ $have == *" avx512vbmi "* ]] && out="$out -DGGML_AVX512_VBMI=ON"
    [[ $have == *" avx512_vnni "* ]] && out="$out -DGGML_AVX512_VNNI=ON"
    [[ $have == *" avx512_bf16 "* ]] && out="$out -DGGML_AVX512_BF16=ON"
  else
    out="-DGGML_AVX512=OFF"
  fi
  [[ $have == *" avx_vnni "* ]] && out="$out -DGGML_AVX_VNNI=ON"
  # ggml's AMX backend holds SSR's rows kernels, which need AVX-512 VNNI only: built wherever the CPU has it; the
  # tiles themselves run only where the CPU has AMX (patch 0006)
  if [[ ${SSR_LLAMA_BUILD:-native} != no-amx && $out == *"AVX512_VNNI=ON"* ]]; then
    out="$out -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON"
    [[ $have == *" amx_bf16 "* ]] && out="$out -DGGML_AMX_BF16=ON"
  else
    out="$out $NO_AMX"
  fi
  echo "$out"
}

patch_source() {  # patch_source SOURCE_DIR: SSR's patches to the vendored llama.cpp (scripts/llama_cpp/*.patch)
  local llama="$1/vendor/llama.cpp" p
  command -v patch >/dev/null || { echo "install_llama_cpp: needs GNU patch (apt-get install patch)"; exit 1; }
  cp "$ROOT"/scripts/llama_cpp/ssr_amx_*.h "$ROOT/scripts/llama_cpp/ssr_quantize.h" "$llama/ggml/src/ggml-cpu/amx/"
  cp "$ROOT/scripts/llama_cpp/ssr_attention.h" "$ROOT"/scripts/llama_cpp/ssr_rows_x86*.h "$llama/ggml/src/ggml-cpu/"
  for p in "$ROOT"/scripts/llama_cpp/*.patch; do
    patch --quiet --batch --forward -p1 -d "$llama" -i "$p" ||
      { echo "install_llama_cpp: $(basename "$p") does not apply to llama-cpp-python $VERSION's source"; exit 1; }
  done
}

wheelhouse() {  # the folder for the wheel built with flags "$1" (from the source as patch_source leaves it)
  local key
  key=$(printf '%s' "$VERSION+$(cat "$ROOT"/scripts/llama_cpp/ssr_*.h "$ROOT"/scripts/llama_cpp/*.patch | sha256sum | cut -c1-12) $1" \
    | sha256sum | cut -c1-12)
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
  local source="$tree/sdist/llama_cpp_python-$VERSION"  # the sdist, unpacked and patched (patch_source)
  "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tree/sdist"
  tar xzf "$tree"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$tree/sdist"
  patch_source "$source"
  # shellcheck disable=SC2086
  CMAKE_ARGS="$(echo $flags $extra)" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$VENV/bin/python" -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
    --config-settings=build-dir="$tree/build" "${targets[@]}" "$source" -w "$house"
  if [ "$TOOLS" = 1 ]; then  # the tools and every shared library they load, run with LD_LIBRARY_PATH=$house/bin
    mkdir -p "$house/bin"
    find "$tree/build" \( -type f -o -type l \) \( -name llama-server -o -name llama-bench -o -name '*.so*' \) \
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
  "$VENV/bin/python" -c "from ssr.backends.llama_cpp import smoke_test; smoke_test()" &&
  # on AMX the embedded models' matmuls all take SSR's kernels: a second child sends them to ggml's AMX tiles, which
  # other GGUF types (Q4_0, Q5_K, IQ4_XS) take
  SSR_AMX_VNNI_ROWS=0 "$VENV/bin/python" -c "from ssr.backends.llama_cpp import smoke_test; smoke_test()"
}

# the builds to try, best first: this CPU's (with AMX where it has AMX), without AMX, portable
if [ "${SSR_LLAMA_BUILD:-native}" = portable ]; then
  CANDIDATES=("$COMMON $PORTABLE")
else
  CANDIDATES=("$COMMON $(cpu_flags)")
  [[ ${CANDIDATES[0]} == *"AMX_INT8=ON"* ]] && CANDIDATES+=("$COMMON $(SSR_LLAMA_BUILD=no-amx cpu_flags)")
  [[ ${CANDIDATES[-1]} != "$COMMON $PORTABLE" ]] && CANDIDATES+=("$COMMON $PORTABLE")
fi
if [ "$PRINT_FLAGS" = 1 ]; then
  for FLAGS in "${CANDIDATES[@]}"; do echo $FLAGS; done
  exit 0
fi
start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
for FLAGS in "${CANDIDATES[@]}"; do
  build "$FLAGS"
  install_wheel "$FLAGS"
  if smoke; then break; fi
  [ "$FLAGS" = "${CANDIDATES[-1]}" ] && { echo "install_llama_cpp: every build failed its first decode"; exit 1; }
  echo "install_llama_cpp: the build ($(echo $FLAGS)) failed its first decode; trying the next"
done
echo "install_llama_cpp: $(( $(date +%s) - start )) s into $VENV (wheel: $(wheelhouse "$FLAGS"))"
