#!/usr/bin/env bash
# Build and install llama-cpp-python (pinned) into a virtual environment: SSR's default CPU engine.
#
#   bash scripts/install_llama_cpp.sh [VENV] [--tools]     (default VENV: .venv at the repository root)
#
# --tools also builds llama.cpp's own `llama-server` and `llama-bench` from the same source and flags (the peers of
# `ssr bench`: benchmarks/ssr_bench/llama_server.py), kept next to the wheel.
#
# Kernels: the build targets the CPU it runs on, feature by feature, from /proc/cpuinfo: AVX2/FMA/F16C always (every
# current x86-64 CPU), AVX-512 (F, VBMI, VNNI, BF16) and AVX-VNNI where the CPU has them, and AMX (tile, int8, bf16)
# where it has those and AVX-512 VNNI. It builds from a patched copy of the sdist (patch_source below: with GCC up to
# 12 the vendored ggml's AMX tile configuration was compiled away, so the first multi-row decode died with SIGILL;
# and exact mode's batch-invariant attention is switched on through the environment).
# After installing, a decode runs in a child process; if it dies, the portable build (AVX2, no AVX-512, no AMX)
# replaces it. SSR_LLAMA_BUILD=portable forces the portable build, SSR_LLAMA_BUILD=no-amx the build for this CPU
# without AMX. docs/backends/llama-cpp.md measures them.
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
PATCHES=ssr4  # names what patch_source changes: a new set of patches gets a new wheel
COMMON="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON
  -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
NO_AMX="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
PORTABLE="-DGGML_AVX512=OFF $NO_AMX"

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
    out="-DGGML_AVX512=OFF"
  fi
  [[ $have == *" avx_vnni "* ]] && out="$out -DGGML_AVX_VNNI=ON"
  if [[ ${SSR_LLAMA_BUILD:-native} != no-amx && $out == *"AVX512_VNNI=ON"* && $have == *" amx_tile "* \
        && $have == *" amx_int8 "* ]]; then  # ggml's AMX kernels need AVX-512 VNNI beside the tiles
    out="$out -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON"
    [[ $have == *" amx_bf16 "* ]] && out="$out -DGGML_AMX_BF16=ON"
  else
    out="$out $NO_AMX"
  fi
  echo "$out"
}

patch_source() {  # patch_source SOURCE_DIR: SSR's five changes to the vendored llama.cpp (each checked to apply)
  # 1. AMX: GCC's _tile_loadconfig (amxtileintrin.h, up to GCC 12) declares an 8-byte memory read, so the compiler
  #    drops the stores of the tile config's rows and column widths as dead: `ldtilecfg` loads a config without rows
  #    and the first `tilezero` raises #UD (SIGILL; found on an AMX Xeon with gdb and objdump). The fix names the
  #    whole 64-byte config as the instruction's operand.
  # 2. GGML_CPU_USE_REF=1 in the environment when a context is created turns on the CPU backend's `use_ref` (the
  #    setter, ggml_backend_cpu_set_use_ref, needs a backend handle that llama.h does not expose): flash attention
  #    then computes every query row alike whatever the batch (no key splitting, no tiles), which exact mode needs.
  # 3. AMX: every matmul of Q4_K, Q6_K or Q8_0 weights runs SSR's VNNI kernels (scripts/llama_cpp/ssr_amx_rows.h)
  #    instead of ggml's one-row kernel and AMX tiles: the same bits a row, and on the Xeon VM of docs/backends/
  #    llama-cpp.md a one-row decode of the 1.5B in 67 ms against 90, four rows in 86 against 123, a prefill 6.0 ms
  #    a token against 6.7. SSR_AMX_VNNI_ROWS=N sends batches over N rows to the tiles (0: all). Q4_K and Q6_K
  #    batches of 32 rows or more take SSR's own tile kernels there (group scales carried in the weight tiles; same
  #    bits a row; a 600-token prefill of the 1.5B 30% faster; SSR_AMX_TILE_ROWS=N moves the 32, 0 turns it off).
  # 4. Exact mode's attention (use_ref): SSR's kernel (scripts/llama_cpp/ssr_attention.h), every row's bits
  #    independent of the batch and of where its keys lie in the cache, as the reference path's are, at about the
  #    tiled kernel's speed (docs/backends/llama-cpp.md); models it does not cover keep the reference path.
  # 5. AMX: the activations' quantization to Q8_K (ggml's reference function, one value at a time) with AVX-512,
  #    the same bits (scripts/llama_cpp/ssr_quantize.h): 6-7% of a prefill of the 1.5B on the Xeon VM.
  cp "$ROOT/scripts/llama_cpp/ssr_amx_rows.h" "$ROOT/scripts/llama_cpp/ssr_quantize.h" "$1/vendor/llama.cpp/ggml/src/ggml-cpu/amx/"
  cp "$ROOT/scripts/llama_cpp/ssr_attention.h" "$1/vendor/llama.cpp/ggml/src/ggml-cpu/"
  "$VENV/bin/python" - "$1/vendor/llama.cpp/ggml/src/ggml-cpu" <<'PY'
import sys
root = sys.argv[1]
mul_mat = "void ggml_backend_amx_mul_mat(const ggml_compute_params * params, struct ggml_tensor * dst) {\n"
one_row = "    if (M == 1) {\n        // MB = 1 and handle 8 tiles in each block\n"
attention = ("static void ggml_compute_forward_flash_attn_ext_f16(\n        const ggml_compute_params * params,\n"
             "        ggml_tensor * dst) {\n")
changes = [
    ("amx/mmq.cpp", mul_mat, '#include "ssr_amx_rows.h"  // SSR: install_llama_cpp.sh\n\n' + mul_mat),
    ("amx/mmq.cpp", one_row, "    if (ssr_rows_mul_mat(params, src0, dst, wdata, M, N, K, ldc, n_batch, ne2)) {  // SSR\n"
                             "        return;\n    }\n" + one_row),
    ("amx/mmq.cpp", "// quantize A from float to `vec_dot_type`\n",
     '#include "ssr_quantize.h"  // SSR: install_llama_cpp.sh\n\n// quantize A from float to `vec_dot_type`\n'),
    ("amx/mmq.cpp", "    // TODO: this is reference impl!\n    quantize_row_q8_K_ref(x, (block_q8_K *)vy, k);\n",
     "    ssr_quantize_row_q8_K(x, (block_q8_K *)vy, k);  // SSR: the reference's bits, AVX-512\n"),
    ("amx/mmq.cpp", "    _tile_loadconfig(&tc);\n",
     '    __asm__ volatile("ldtilecfg %0" : : "m"(tc));  // the whole config read (SSR: install_llama_cpp.sh)\n'),
    ("ops.cpp", attention, '#include "ssr_attention.h"  // SSR: install_llama_cpp.sh\n\n' + attention
                            + "    if (ssr_flash_attn_ext(params, dst)) {  // SSR: exact mode's attention\n"
                              "        return;\n    }\n"),
    ("ggml-cpu.cpp", "    ctx->use_ref             = false;\n",
     '    ctx->use_ref             = getenv("GGML_CPU_USE_REF") != NULL;  // SSR: install_llama_cpp.sh\n'),
]
for name, old, new in changes:
    path = f"{root}/{name}"
    text = open(path).read()
    if text.count(old) != 1:
        sys.exit(f"install_llama_cpp: {path} is not the source these patches were written for")
    open(path, "w").write(text.replace(old, new))
PY
}

wheelhouse() {  # the folder for the wheel built with flags "$1" (from the source as patch_source leaves it)
  local key
  key=$(printf '%s' "$VERSION+$PATCHES+$(cat "$ROOT"/scripts/llama_cpp/ssr_*.h | sha256sum | cut -c1-12) $1" \
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

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# the builds to try, best first: this CPU's (with AMX where it has AMX), without AMX, portable
if [ "${SSR_LLAMA_BUILD:-native}" = portable ]; then
  CANDIDATES=("$COMMON $PORTABLE")
else
  CANDIDATES=("$COMMON $(cpu_flags)")
  [[ ${CANDIDATES[0]} == *"AMX_INT8=ON"* ]] && CANDIDATES+=("$COMMON $(SSR_LLAMA_BUILD=no-amx cpu_flags)")
  [[ ${CANDIDATES[-1]} != "$COMMON $PORTABLE" ]] && CANDIDATES+=("$COMMON $PORTABLE")
fi
for FLAGS in "${CANDIDATES[@]}"; do
  build "$FLAGS"
  install_wheel "$FLAGS"
  if smoke; then break; fi
  [ "$FLAGS" = "${CANDIDATES[-1]}" ] && { echo "install_llama_cpp: every build failed its first decode"; exit 1; }
  echo "install_llama_cpp: the build ($(echo $FLAGS)) failed its first decode; trying the next"
done
echo "install_llama_cpp: $(( $(date +%s) - start )) s into $VENV (wheel: $(wheelhouse "$FLAGS"))"
