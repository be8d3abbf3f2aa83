"""SSR's x86 rows kernels (scripts/llama_cpp/ssr_rows_x86.h: exact mode's matmuls on x86 CPUs without SSR's
AVX-512 layout), compiled on their own for each SIMD level and checked bit for bit, whatever the batch (1 to 16
tokens, starting anywhere) and the thread split:
- on ggml's own weight layout (Q8_0, Q4_K, Q6_K), every (weight row, token) has the bits of ggml's one-row vec_dot
  (from the installed libggml-cpu), the bits it has alone;
- on SSR's eight-row layouts for the same types (patch 0008), every (weight row, token) has the bits of a scalar
  reference that computes that row and token alone: its blocks' integer sums, each scaled and added with one fused
  multiply-add.
The model tests (tests/test_llama_cpp.py) check the same through whole decodes.

A level this CPU lacks is compiled and skipped with the reason; without gcc or llama-cpp-python all skip."""

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
#include <math.h>
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
struct traits_cpu { void * from_float; ggml_vec_dot_t vec_dot; enum ggml_type vec_dot_type; int64_t nrows; };

static void fill_q8_K(block_q8_K * a) {
    a->d = 0.01f * (1 + rand() % 100);
    for (int j = 0; j < QK_K; ++j) a->qs[j] = rand() % 255 - 127;
    for (int g = 0; g < 16; ++g) { int s = 0; for (int j = 0; j < 16; ++j) s += a->qs[g * 16 + j]; a->bsums[g] = s; }
}
"""

MAIN = r"""

// N weight rows of K values and 16 tokens, random in the ranges ggml's quantizers give; every batch of 1..16 tokens
// starting at tokens 0..3, split over 1 and 3 threads, against vec_dot of each (weight row, token): 0 if all equal.
static int check(enum ggml_type type, ggml_vec_dot_t vec_dot) {
    const int N = 37, K = 1024, TMAX = 20;
    const int wb = type == GGML_TYPE_Q8_0 ? (int)sizeof(block_q8_0) * (K / QK8_0)
                 : type == GGML_TYPE_Q4_K ? (int)sizeof(block_q4_K) * (K / QK_K)
                                          : (int)sizeof(block_q6_K) * (K / QK_K);
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

LAYOUT_MAIN = r"""

// Row r, token t alone, as SSR's layout defines it: per block, the integer sums of (scale x) values . token and
// (for Q4_K) of min x the token's sums of 32, each in one fused multiply-add, Q4_K's two accumulators subtracted;
// Q6_K's values unsigned, less 32 x scale x the token's sums of 16 in the integer sum.
static float reference(enum ggml_type type, const char * row, const char * tok, int nb) {
    float acc = 0.0f, acc_m = 0.0f;
    for (int ib = 0; ib < nb; ++ib) {
        if (type == GGML_TYPE_Q8_0) {
            const block_q8_0 * x = (const block_q8_0 *)row + ib, * y = (const block_q8_0 *)tok + ib;
            int sumi = 0;
            for (int j = 0; j < QK8_0; ++j) sumi += x->qs[j] * y->qs[j];
            acc = fmaf(GGML_CPU_FP16_TO_FP32(x->d) * GGML_CPU_FP16_TO_FP32(y->d), (float)sumi, acc);
        } else if (type == GGML_TYPE_Q6_K) {
            const block_q6_K * x = (const block_q6_K *)row + ib;
            const block_q8_K * y = (const block_q8_K *)tok + ib;
            uint8_t q[QK_K];
            ssr_x86_q6_K_values(x, q);
            int sumi = 0, corr = 0;
            for (int g = 0; g < 16; ++g) {
                int dot = 0;
                for (int i = 0; i < 16; ++i) dot += q[16 * g + i] * y->qs[16 * g + i];
                sumi += x->scales[g] * dot;
                corr += x->scales[g] * y->bsums[g];
            }
            acc = fmaf(GGML_CPU_FP16_TO_FP32(x->d) * y->d, (float)(sumi - 32 * corr), acc);
        } else {
            const block_q4_K * x = (const block_q4_K *)row + ib;
            const block_q8_K * y = (const block_q8_K *)tok + ib;
            uint8_t sc[8], m[8];
            ssr_x86_q4_K_scales(x->scales, sc, m);
            int sumi = 0, summ = 0;
            for (int j = 0; j < 8; ++j) {
                int dot = 0, ysum = 0;
                for (int i = 0; i < 32; ++i) {
                    const int q = j % 2 ? x->qs[32 * (j / 2) + i] >> 4 : x->qs[32 * (j / 2) + i] & 0xF;
                    dot += q * y->qs[32 * j + i];
                    ysum += y->qs[32 * j + i];
                }
                sumi += sc[j] * dot;
                summ += m[j] * ysum;
            }
            acc = fmaf(GGML_CPU_FP16_TO_FP32(x->d) * y->d, (float)sumi, acc);
            acc_m = fmaf(GGML_CPU_FP16_TO_FP32(x->dmin) * y->d, (float)summ, acc_m);
        }
    }
    return acc - acc_m;
}

// N weight rows (whole groups of eight) and 20 tokens, random in the ranges ggml's quantizers give, repacked into
// SSR's layout; every batch of 1..16 tokens starting at tokens 0..3, split over 1 and 3 threads, against reference()
// bit for bit, and reference() against ggml's vec_dot within float rounding (the layout computes what ggml's does).
static int check(enum ggml_type type, ggml_vec_dot_t vec_dot) {
    enum { N = 40, K = 1024, TMAX = 20 };
    const int q8_0 = type == GGML_TYPE_Q8_0, nb = K / (q8_0 ? QK8_0 : QK_K);
    const size_t wb = (q8_0 ? sizeof(block_q8_0) : type == GGML_TYPE_Q4_K ? sizeof(block_q4_K)
                                                   : sizeof(block_q6_K)) * nb;
    const size_t yb = (q8_0 ? sizeof(block_q8_0) : sizeof(block_q8_K)) * nb;
    char * W = malloc(N * wb), * Y = malloc(TMAX * yb);
    for (size_t i = 0; i < N * wb; ++i) W[i] = rand();
    for (int r = 0; r < N; ++r) {
        for (int b = 0; b < nb; ++b) {
            if (q8_0) {
                block_q8_0 * x = (block_q8_0 *)(W + r * wb) + b;
                x->d = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
                for (int j = 0; j < QK8_0; ++j) if (x->qs[j] == -128 || r % 7 == 0) x->qs[j] = j % 3 ? 127 : -127;
            } else if (type == GGML_TYPE_Q6_K) {
                block_q6_K * x = (block_q6_K *)(W + r * wb) + b;
                x->d = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
                if (r % 7 == 0) {  // every value 63 and every scale -128: the sums' largest
                    memset(x->ql, 0xFF, sizeof(x->ql));
                    memset(x->qh, 0xFF, sizeof(x->qh));
                    memset(x->scales, 0x80, sizeof(x->scales));
                }
            } else {
                block_q4_K * x = (block_q4_K *)(W + r * wb) + b;
                x->d = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
                x->dmin = _cvtss_sh(0.0003f * (1 + rand() % 60), 0);
                if (r % 7 == 0) memset(x->qs, 0xFF, sizeof(x->qs));  // every value 15: the 16-bit sums' largest
            }
        }
    }
    for (int t = 0; t < TMAX; ++t) {
        for (int b = 0; b < nb; ++b) {
            if (q8_0) {
                block_q8_0 * y = (block_q8_0 *)(Y + t * yb) + b;
                y->d = _cvtss_sh(0.01f * (1 + rand() % 100), 0);
                for (int j = 0; j < QK8_0; ++j) y->qs[j] = t % 5 ? rand() % 255 - 127 : (j % 2 ? 127 : -127);
            } else {
                block_q8_K * y = (block_q8_K *)(Y + t * yb) + b;
                fill_q8_K(y);
                if (t % 5 == 0) {
                    for (int j = 0; j < QK_K; ++j) y->qs[j] = 127;
                    for (int g = 0; g < 16; ++g) y->bsums[g] = 16 * 127;
                }
            }
        }
    }
    float ref[TMAX][N];
    int bad = 0;
    for (int t = 0; t < TMAX; ++t) {
        for (int r = 0; r < N; ++r) {
            float vd;
            ref[t][r] = reference(type, W + r * wb, Y + t * yb, nb);
            vec_dot(K, &vd, 0, W + r * wb, 0, Y + t * yb, 0, 1);
            if (fabsf(ref[t][r] - vd) > 1e-3f * (1.0f + fabsf(vd))) {
                printf("type %d row %d token %d: %g against vec_dot's %g\n", type, r, t, ref[t][r], vd);
                bad = 1;
            }
        }
    }
    void * packed = malloc(N / 8 * nb * sizeof(ssr_block_q6_Kx8));  // the largest of the three layouts
    if (q8_0) ssr_x86_repack_q8_0(N, K, (const block_q8_0 *)W, packed);
    else if (type == GGML_TYPE_Q4_K) ssr_x86_repack_q4_K(N, K, (const block_q4_K *)W, packed);
    else ssr_x86_repack_q6_K(N, K, (const block_q6_K *)W, packed);
    struct ggml_tensor src0 = { type, { K, N, 1, 1 }, { 0, 0, 0, 0 }, packed };
    float * out = malloc(sizeof(float) * 16 * N);
    for (int T = 1; T <= 16; ++T) {
        for (int first = 0; first < 4; ++first) {
            for (int nth = 1; nth <= 3; nth += 2) {
                memset(out, 0, sizeof(float) * 16 * N);
                struct ggml_tensor dst = { GGML_TYPE_F32, { N, T, 1, 1 }, { 4, sizeof(float) * N, 0, 0 }, out };
                for (int ith = 0; ith < nth; ++ith) {
                    struct ggml_compute_params p = { ith, nth };
                    ssr_x86_layout_mul_mat(&p, &src0, &dst, Y + first * yb, yb);
                }
                if (memcmp(out, ref[first], sizeof(float) * T * N)) {
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
    void (*cpu_init)(void) = dlsym(lib, "ggml_cpu_init");
    cpu_init();
    srand(7);
    int bad = check(GGML_TYPE_Q8_0, traits(GGML_TYPE_Q8_0)->vec_dot);
    bad |= check(GGML_TYPE_Q4_K, traits(GGML_TYPE_Q4_K)->vec_dot);
    bad |= check(GGML_TYPE_Q6_K, traits(GGML_TYPE_Q6_K)->vec_dot);
    puts(bad ? "differs" : "identical");
}
"""


def _ggml_cpu_library() -> Path:
    llama_cpp = pytest.importorskip("llama_cpp")
    found = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu*.so*"))
    if not found:
        pytest.skip("llama-cpp-python without its libggml-cpu")
    return found[0]


def _compile(tmp_path: Path, level: str, main: str) -> Path:
    """The header and ``main`` built for ``level``; skips where gcc is missing or this CPU cannot run the level."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc to compile the kernels with")
    gcc_flags, cpu_flags = LEVELS[level]
    src, exe = tmp_path / "rows.c", tmp_path / "rows"
    src.write_text(PRELUDE + (HEADERS / "ssr_rows_x86.h").read_text() + main)
    subprocess.run(["gcc", "-O2", "-std=c11", "-ffp-contract=off", *gcc_flags, str(src), "-o", str(exe), "-ldl",
                    "-lm"], check=True, capture_output=True)  # every level compiles on any x86 machine
    missing = [f for f in cpu_flags if f not in (_cpuinfo().get("flags") or "").split()]
    if missing:
        pytest.skip(f"compiled; this CPU lacks {', '.join(missing)} to run it")
    return exe


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_every_row_has_vec_dots_bits_in_every_batch(tmp_path, level):
    """Q8_0, Q4_K, Q6_K at each SIMD level: every (weight row, token) of batches of 1 to 16 tokens, at every place
    in a group of eight and on 1 or 3 threads, bitwise ggml's one-row vec_dot (exact mode's promise: a row has the
    bits it has alone)."""
    library = _ggml_cpu_library()
    exe = _compile(tmp_path, level, MAIN)
    out = subprocess.run([str(exe), str(library)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "identical", out


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_layout_rows_have_their_own_bits_in_every_batch(tmp_path, level):
    """SSR's eight-row Q8_0, Q4_K and Q6_K layouts at each SIMD level: every (weight row, token) of batches of 1 to 16
    tokens, at every place in a group of tokens and on 1 or 3 threads, bitwise the row and token computed alone by
    a scalar reference (so also the same bits at every level), which agrees with ggml's vec_dot within rounding."""
    library = _ggml_cpu_library()
    exe = _compile(tmp_path, level, LAYOUT_MAIN)
    out = subprocess.run([str(exe), str(library)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "identical", out
