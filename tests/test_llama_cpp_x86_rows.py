"""SSR's rows kernels on ggml's own weight layout (scripts/llama_cpp/ssr_rows_x86.h: exact mode's matmuls on
x86 CPUs without SSR's AVX-512 layout), compiled on their own for each SIMD level and checked bit for bit: every
(weight row, token) of a batch of 1 to 16 tokens, whatever the thread split, has the bits of ggml's own one-row
vec_dot (from the installed libggml-cpu), the bits it has alone. The model tests (tests/test_llama_cpp.py) check
the same through whole decodes.

A level this CPU lacks is compiled and skipped with the reason; without g++ or llama-cpp-python all skip."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ssr.calibrate import _cpuinfo

HEADERS = Path(__file__).resolve().parent.parent / "scripts" / "llama_cpp"

# The SIMD levels the header has a path for: g++ flags, and the /proc/cpuinfo flags a CPU needs to run them.
LEVELS = {
    "avx2": (["-mavx2", "-mfma", "-mf16c"], ["avx2", "fma", "f16c"]),
    "avx-vnni": (["-mavx2", "-mfma", "-mf16c", "-mavxvnni"], ["avx2", "fma", "f16c", "avx_vnni"]),
    "avx512-vnni": (["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vl", "-mavx512vnni"],
                    ["avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512_vnni"]),
}

# The stand-ins for what ggml-cpu.c defines before it includes the header (the block layouts are ggml's; the types'
# numbers are ggml.h's, since the program asks the installed library for its vec_dot by them).
PRELUDE = r"""
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#define QK8_0 32
#define QK_K 256
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define GGML_CPU_FP16_TO_FP32(x) _cvtsh_ss(x)
typedef uint16_t ggml_half;
enum ggml_type { GGML_TYPE_F32 = 0, GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q6_K = 14, GGML_TYPE_Q8_K = 15 };
typedef struct { ggml_half d; int8_t qs[QK8_0]; } block_q8_0;
typedef struct { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; } block_q8_K;
typedef struct { ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; ggml_half d; } block_q6_K;
struct ggml_compute_params { int ith, nth; };
struct ggml_tensor { enum ggml_type type; int64_t ne[4]; size_t nb[4]; void * data; };
typedef void (*ggml_vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
"""

MAIN = r"""
struct traits_cpu { void * from_float; ggml_vec_dot_t vec_dot; enum ggml_type vec_dot_type; int64_t nrows; };

static void fill_q8_K(block_q8_K * a) {
    a->d = 0.01f * (1 + rand() % 100);
    for (int j = 0; j < QK_K; ++j) a->qs[j] = rand() % 255 - 127;
    for (int g = 0; g < 16; ++g) { int s = 0; for (int j = 0; j < 16; ++j) s += a->qs[g * 16 + j]; a->bsums[g] = s; }
}

// N weight rows of K values and 16 tokens, random in the ranges ggml's quantizers give; every batch of 1..16 tokens
// starting at tokens 0..3, split over 1 and 3 threads, against vec_dot of each (weight row, token): 0 if all equal.
static int check(enum ggml_type type, ggml_vec_dot_t vec_dot) {
    const int N = 37, K = 1024, TMAX = 20;
    const int wb = type == GGML_TYPE_Q8_0 ? (int)sizeof(block_q8_0) * (K / QK8_0)
                 : type == GGML_TYPE_Q4_K ? (int)sizeof(block_q4_K) * (K / QK_K) : (int)sizeof(block_q6_K) * (K / QK_K);
    const int yb = type == GGML_TYPE_Q8_0 ? (int)sizeof(block_q8_0) * (K / QK8_0) : (int)sizeof(block_q8_K) * (K / QK_K);
    char * W = malloc((size_t)N * wb), * Y = malloc((size_t)TMAX * yb);
    for (int i = 0; i < N * wb; ++i) W[i] = rand();
    for (int r = 0; r < N; ++r) {  // the fields with a fixed range: f16 scales, 6-bit packed scales stay random
        char * row = W + (size_t)r * wb;
        if (type == GGML_TYPE_Q8_0) {
            for (int b = 0; b < K / QK8_0; ++b) {
                block_q8_0 * x = (block_q8_0 *)row + b;
                x->d = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
                for (int j = 0; j < QK8_0; ++j) if (x->qs[j] == -128) x->qs[j] = r % 2 ? 127 : -127;
            }
        } else if (type == GGML_TYPE_Q4_K) {
            for (int b = 0; b < K / QK_K; ++b) {
                block_q4_K * x = (block_q4_K *)row + b;
                x->d = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
                x->dmin = _cvtss_sh(0.0003f * (1 + rand() % 60), 0);
            }
        } else {
            for (int b = 0; b < K / QK_K; ++b) ((block_q6_K *)row + b)->d = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
        }
    }
    for (int t = 0; t < TMAX; ++t) {
        char * row = Y + (size_t)t * yb;
        if (type == GGML_TYPE_Q8_0) {
            for (int b = 0; b < K / QK8_0; ++b) {
                block_q8_0 * y = (block_q8_0 *)row + b;
                y->d = _cvtss_sh(0.01f * (1 + rand() % 100), 0);
                for (int j = 0; j < QK8_0; ++j) y->qs[j] = t % 5 ? rand() % 255 - 127 : (j % 2 ? 127 : -127);
            }
        } else {
            for (int b = 0; b < K / QK_K; ++b) fill_q8_K((block_q8_K *)row + b);
        }
    }
    float * vd = malloc(sizeof(float) * TMAX * N), * out = malloc(sizeof(float) * 16 * N);
    for (int t = 0; t < TMAX; ++t)
        for (int r = 0; r < N; ++r) vec_dot(K, vd + t * N + r, 0, W + (size_t)r * wb, 0, Y + (size_t)t * yb, 0, 1);
    struct ggml_tensor src0 = { type, { K, N, 1, 1 }, { 0, (size_t)wb, 0, 0 }, W };
    int bad = 0;
    for (int T = 1; T <= 16; ++T) {
        for (int first = 0; first < 4; ++first) {
            for (int nth = 1; nth <= 3; nth += 2) {
                memset(out, 0, sizeof(float) * 16 * N);
                struct ggml_tensor dst = { GGML_TYPE_Q8_K, { N, T, 1, 1 }, { 4, sizeof(float) * N, 0, 0 }, out };
                for (int ith = 0; ith < nth; ++ith) {
                    struct ggml_compute_params p = { ith, nth };
                    ssr_x86_rows_mul_mat(&p, &src0, &dst, Y + (size_t)first * yb, yb, vec_dot);
                }
                if (memcmp(out, vd + first * N, sizeof(float) * T * N)) {
                    printf("type %d: %d tokens from %d on %d threads differ\n", type, T, first, nth);
                    bad = 1;
                }
            }
        }
    }
    return bad;
}

int main(int argc, char ** argv) {
    void * lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) { printf("dlopen: %s\n", dlerror()); return 2; }
    const struct traits_cpu * (*traits)(enum ggml_type) = dlsym(lib, "ggml_get_type_traits_cpu");
    void (*cpu_init)(void) = dlsym(lib, "ggml_cpu_init");  // ggml's tables, before any vec_dot runs
    cpu_init();
    srand(5);
    const enum ggml_type types[3] = { GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K };
    int bad = 0;
    for (int i = 0; i < 3; ++i) bad |= check(types[i], traits(types[i])->vec_dot);
    puts(bad ? "differs" : "identical");
}
"""


def _ggml_cpu_library() -> Path:
    llama_cpp = pytest.importorskip("llama_cpp")
    found = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu*.so*"))
    if not found:
        pytest.skip("llama-cpp-python without its libggml-cpu")
    return found[0]


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_row_has_vec_dots_bits_in_every_batch(tmp_path, level):
    """Q8_0, Q4_K, Q6_K at each SIMD level: every (weight row, token) of batches of 1 to 16 tokens, at every place
    in a group of four and on 1 or 3 threads, bitwise ggml's one-row vec_dot (exact mode's promise: a row has the
    bits it has alone)."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to compile the kernels with")
    library = _ggml_cpu_library()
    gcc_flags, cpu_flags = LEVELS[level]
    src, exe = tmp_path / "rows.c", tmp_path / "rows"
    src.write_text(PRELUDE + (HEADERS / "ssr_rows_x86.h").read_text() + MAIN)
    subprocess.run(["gcc", "-O2", "-std=c11", *gcc_flags, str(src), "-o", str(exe), "-ldl"], check=True,
                   capture_output=True)  # every level compiles on any x86 machine
    missing = [f for f in cpu_flags if f not in (_cpuinfo().get("flags") or "").split()]
    if missing:
        pytest.skip(f"compiled; this CPU lacks {', '.join(missing)} to run it")
    out = subprocess.run([str(exe), str(library)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "identical", out
