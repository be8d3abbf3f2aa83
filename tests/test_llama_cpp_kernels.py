"""SSR's C++ additions to llama.cpp (scripts/llama_cpp/), compiled on their own and checked bit for bit: the rows
kernels give every row the bits it has computed alone, in batches of 1 to 16 rows; the AMX tile kernels for Q4_K
and Q6_K give the rows kernels' bits; the AVX-512 quantizer gives ggml's reference function's (in the installed
libggml-base); the install script picks the build for given CPU flags. The model tests (tests/test_llama_cpp.py)
check the same through whole decodes; these pin every batch size and edge case.

They skip without g++, without the CPU features the code needs (AVX-512 VNNI; AMX for the tiles), and, for the
quantizer, without llama-cpp-python."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ssr.calibrate import _cpuinfo

HEADERS = Path(__file__).resolve().parent.parent / "scripts" / "llama_cpp"
FLAGS = ["-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
         "-mfma", "-mamx-tile", "-mamx-int8"]

# The stand-ins for what ggml-cpu/amx/mmq.cpp defines before it includes the headers.
PRELUDE = r"""
#include <immintrin.h>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <unistd.h>
#include <sys/syscall.h>
#define QK_K 256
#define TILE_N 16
#define TILE_K 32
#define RESTRICT __restrict__
#define PACKED_INDEX(n, k, KB, tile_size) (n * KB + k) * tile_size
#define GGML_CPU_FP16_TO_FP32(x) _cvtsh_ss(x)
typedef uint16_t ggml_half;
enum ggml_type { GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q8_0 };
struct block_q8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
struct block_q4_K { ggml_half d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; ggml_half d; };
struct block_q8_0 { ggml_half d; int8_t qs[32]; };
#include "ssr_amx_cpu.h"
"""

# The rows kernel over one block of 64 output columns, M rows grouped as ssr_rows_work groups them (4 at a time, the
# rest in a smaller group); after the kernels in every program below.
GROUPED = r"""
template <typename TB, typename TA>
void grouped_rows(int KB, const TA * A, int M, const char * Bn, float * C, int ldc) {
    for (int m = 0; m < M; m += 4) {
        const TA * Am = A + (size_t)m * KB;
        float * Cm = C + (size_t)m * ldc;
        switch (std::min(4, M - m)) {
            case 1: ssr_rows_kernel<TB, 1, 4>::apply(KB, Am, Bn, Cm, ldc); break;
            case 2: ssr_rows_kernel<TB, 2, 4>::apply(KB, Am, Bn, Cm, ldc); break;
            case 3: ssr_rows_kernel<TB, 3, 4>::apply(KB, Am, Bn, Cm, ldc); break;
            default: ssr_rows_kernel<TB, 4, 4>::apply(KB, Am, Bn, Cm, ldc); break;
        }
    }
}
"""

TILES_MAIN = r"""
// packed weights as ggml lays them out, random but for the fields with a fixed range
static void fill(block_q4_K *, char * tile) {  // 6-bit scales and mins, f16 d and dmin
    uint8_t * sc = (uint8_t *)tile + (QK_K / 2) * TILE_N;
    for (int j = 0; j < 16 * TILE_N; ++j) sc[j] &= 63;
    uint16_t * h = (uint16_t *)(sc + 16 * TILE_N);
    for (int j = 0; j < 2 * TILE_N; ++j) h[j] = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
}
static void fill(block_q6_K *, char * tile) {  // signed 8-bit scales (every value), f16 d
    uint16_t * h = (uint16_t *)(tile + (QK_K / 2) * TILE_N + (QK_K / 4) * TILE_N + 16 * TILE_N);
    for (int j = 0; j < TILE_N; ++j) h[j] = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
}

template <typename TB> int check() {
    const int N = 256, K = 1536, KB = K / QK_K, TS = ssr_packed<TB>::TILE_SIZE, MMAX = 100;
    char * B = (char *)aligned_alloc(64, (size_t)N / 16 * KB * TS);
    for (size_t i = 0; i < (size_t)N / 16 * KB * TS; ++i) B[i] = rand();
    for (int t = 0; t < N / 16 * KB; ++t) fill((TB *)nullptr, B + (size_t)t * TS);
    block_q8_K * A = (block_q8_K *)aligned_alloc(64, (size_t)MMAX * KB * sizeof(block_q8_K));
    for (int i = 0; i < MMAX * KB; ++i) {
        A[i].d = 0.01f * (1 + rand() % 100);
        for (int j = 0; j < QK_K; ++j) A[i].qs[j] = i % 7 ? rand() % 256 - 128 : (j % 2 ? 127 : -128);  // and extremes
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int j = 0; j < 16; ++j) s += A[i].qs[g * 16 + j];
            A[i].bsums[g] = s;
        }
    }
    float * rows = (float *)malloc(sizeof(float) * MMAX * N), * tiles = (float *)malloc(sizeof(float) * MMAX * N);
    int bad = 0;
    for (int M : {8, 9, 12, 16, 17, 24, 31, 32, 100}) {
        for (int nb = 0; nb < N / 64; ++nb) {
            const char * Bn = B + PACKED_INDEX(nb * 4, 0, KB, TS);
            grouped_rows<TB>(KB, A, M, Bn, rows + nb * 64, N);
            ssr_tiles_configure();
            ssr_tiles<TB>(KB, A, M, Bn, 4, tiles + nb * 64, N);
            ssr_tiles_restore();
        }
        if (memcmp(rows, tiles, sizeof(float) * M * N)) { printf("M=%d differs\n", M); bad = 1; }
    }
    return bad;
}

int main() {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no-amx"); return 0; }
    srand(7);
    const int bad = check<block_q4_K>() | check<block_q6_K>() << 1;
    puts(bad ? (bad == 1 ? "Q4_K differs" : bad == 2 ? "Q6_K differs" : "both differ") : "identical");
}
"""

ROWS_MAIN = r"""
// Packed weights of every type as ggml's AMX layout holds them: random bytes, the scales and d in their ranges.
static void fill(block_q8_0 *, char * tile) {  // int8 values, f16 d, int32 compensation (any value)
    uint16_t * h = (uint16_t *)(tile + TILE_N * TILE_K);
    for (int j = 0; j < TILE_N; ++j) h[j] = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
}
static void fill(block_q4_K *, char * tile) {
    uint8_t * sc = (uint8_t *)tile + (QK_K / 2) * TILE_N;
    for (int j = 0; j < 16 * TILE_N; ++j) sc[j] &= 63;
    uint16_t * h = (uint16_t *)(sc + 16 * TILE_N);
    for (int j = 0; j < 2 * TILE_N; ++j) h[j] = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
}
static void fill(block_q6_K *, char * tile) {
    uint16_t * h = (uint16_t *)(tile + (QK_K / 2) * TILE_N + (QK_K / 4) * TILE_N + 16 * TILE_N);
    for (int j = 0; j < TILE_N; ++j) h[j] = _cvtss_sh(0.0005f * (1 + rand() % 60), 0);
}
template <typename TB> struct traits;  // the activations' block type, values a block, a packed tile's bytes
template <> struct traits<block_q8_0> {
    using TA = block_q8_0;
    static constexpr int K = 32, TS = TILE_N * sizeof(block_q8_0) + TILE_N * 4;
    static void fill_a(TA & a) { a.d = _cvtss_sh(0.01f * (1 + rand() % 100), 0); for (auto & q : a.qs) q = rand() % 256 - 128; }
};
static void fill_q8_K(block_q8_K & a) {
    a.d = 0.01f * (1 + rand() % 100);
    for (auto & q : a.qs) q = rand() % 256 - 128;
    for (int g = 0; g < 16; ++g) { int s = 0; for (int j = 0; j < 16; ++j) s += a.qs[g * 16 + j]; a.bsums[g] = s; }
}
template <> struct traits<block_q4_K> {
    using TA = block_q8_K;
    static constexpr int K = QK_K, TS = ssr_packed<block_q4_K>::TILE_SIZE;
    static void fill_a(TA & a) { fill_q8_K(a); }
};
template <> struct traits<block_q6_K> {
    using TA = block_q8_K;
    static constexpr int K = QK_K, TS = ssr_packed<block_q6_K>::TILE_SIZE;
    static void fill_a(TA & a) { fill_q8_K(a); }
};

// M rows into C (N columns), every block of 64 columns in turn.
template <typename TB> void rows(int KB, const typename traits<TB>::TA * A, int M, const char * B, int N, float * C) {
    for (int nb = 0; nb < N / 64; ++nb) {
        grouped_rows<TB>(KB, A, M, B + PACKED_INDEX(nb * 4, 0, KB, traits<TB>::TS), C + nb * 64, N);
    }
}

// Every row of every batch of 1..16 rows (taken at offsets 0..3 of the activations, so that a row sits in every
// place of its group) against the same row computed alone: 0 where all are bitwise equal.
template <typename TB> int check() {
    using T = traits<TB>;
    const int N = 128, K = 2048, KB = K / T::K, MMAX = 20;
    char * B = (char *)aligned_alloc(64, (size_t)N / 16 * KB * T::TS);
    for (size_t i = 0; i < (size_t)N / 16 * KB * T::TS; ++i) B[i] = rand();
    for (int t = 0; t < N / 16 * KB; ++t) fill((TB *)nullptr, B + (size_t)t * T::TS);
    auto * A = (typename T::TA *)aligned_alloc(64, (size_t)MMAX * KB * sizeof(typename T::TA));
    for (int i = 0; i < MMAX * KB; ++i) T::fill_a(A[i]);
    float * alone = (float *)malloc(sizeof(float) * MMAX * N), * batch = (float *)malloc(sizeof(float) * 16 * N);
    for (int r = 0; r < MMAX; ++r) rows<TB>(KB, A + (size_t)r * KB, 1, B, N, alone + (size_t)r * N);
    int bad = 0;
    for (int M = 1; M <= 16; ++M) {
        for (int first = 0; first < 4; ++first) {
            rows<TB>(KB, A + (size_t)first * KB, M, B, N, batch);
            if (memcmp(batch, alone + (size_t)first * N, sizeof(float) * M * N)) { printf("M=%d at %d differs\n", M, first); bad = 1; }
        }
    }
    return bad;
}

int main() {
    srand(11);
    const int q8 = check<block_q8_0>(), q4 = check<block_q4_K>(), q6 = check<block_q6_K>();
    printf("Q8_0 %s, Q4_K %s, Q6_K %s\n", q8 ? "differs" : "identical", q4 ? "differs" : "identical", q6 ? "differs" : "identical");
}
"""

QUANTIZE_MAIN = r"""
int main(int argc, char ** argv) {
    const long k = atol(argv[1]), n = atol(argv[2]);
    float * x = (float *)malloc(sizeof(float) * k * n);
    if (fread(x, sizeof(float), k * n, stdin) != (size_t)(k * n)) return 2;
    block_q8_K * y = (block_q8_K *)calloc(k * n / QK_K, sizeof(block_q8_K));
    for (long r = 0; r < n; ++r) ssr_quantize_row_q8_K(x + r * k, y + r * k / QK_K, k);
    fwrite(y, sizeof(block_q8_K), k * n / QK_K, stdout);
}
"""


def _compile(tmp_path: Path, name: str, source: str) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile the kernels with")
    src, exe = tmp_path / f"{name}.cpp", tmp_path / name
    src.write_text(source)
    subprocess.run(["g++", *FLAGS, f"-I{HEADERS}", str(src), "-o", str(exe)], check=True, capture_output=True)
    return exe


def _needs(*flags: str) -> None:
    have = set((_cpuinfo().get("flags") or "").split())
    missing = [f for f in flags if f not in have]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}")


def _kernels_part() -> str:
    """ssr_amx_rows.h's kernels, without the dispatch that needs ggml's own definitions."""
    text = (HEADERS / "ssr_amx_rows.h").read_text()
    start = text.index("template <typename TB> struct ssr_has_rows_kernel")
    return text[start:text.index("// The work items [begin, end) of ssr_rows_mul_mat")]


def test_rows_kernels_give_a_row_its_bits_alone_in_every_batch(tmp_path):
    """Q8_0, Q4_K, Q6_K: every row of a batch of 1 to 16 rows, in every place of its group of four, has the bits
    it has computed alone (exact mode's promise on every CPU these kernels run on, AMX or not)."""
    _needs("avx512bw", "avx512vl", "avx512_vnni")
    exe = _compile(tmp_path, "rows", PRELUDE + _kernels_part() + GROUPED + ROWS_MAIN)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "Q8_0 identical, Q4_K identical, Q6_K identical", out


def test_tiles_give_the_rows_kernels_bits_at_every_batch_size(tmp_path):
    """Q4_K and Q6_K: integer for integer the tile kernel's block sums are the rows kernel's (every scale, the
    activations' extremes), and its float operations are the rows kernel's function: every row bitwise equal, for
    full groups of 16 rows, padded last groups, and many groups."""
    _needs("avx512_vnni", "amx_int8", "amx_tile")
    exe = _compile(tmp_path, "tiles", PRELUDE + _kernels_part() + GROUPED + TILES_MAIN)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    if out.strip() == "no-amx":
        pytest.skip("the kernel refuses this process AMX state (arch_prctl)")
    assert out.strip().endswith("identical"), out


def test_the_quantizer_gives_ggml_references_bits(tmp_path):
    """ssr_quantize_row_q8_K against the installed libggml-base's quantize_row_q8_K_ref, on rows of every scale
    and the edge cases: a block of zeros, the largest magnitude twice with both signs, values on .5."""
    _needs("avx512bw", "avx512_vnni")
    llama_cpp = pytest.importorskip("llama_cpp")
    libs = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so*"))
    if not libs:
        pytest.skip("llama-cpp-python without its libggml-base")
    base = ctypes.CDLL(str(libs[0]))
    exe = _compile(tmp_path, "quantize", PRELUDE + (HEADERS / "ssr_quantize.h").read_text() + QUANTIZE_MAIN)
    k, n, block = 1536, 40, 4 + 256 + 32
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-4, 4, (n, 1))).astype(np.float32)
    x[0, :256] = 0  # amax 0: d = 0, qs = 0
    x[1, :256] = np.tile([-1.0, 0.0, 1.0], 86)[:256]  # the largest magnitude first with a minus sign
    x[2, 256:512] = 0.5 * np.arange(-128, 128)  # halves: round half to even in nearest_int
    x[3, 5], x[3, 9] = -30.0, 30.0  # a tie of opposite signs: the first wins
    ours = subprocess.run([str(exe), str(k), str(n)], input=x.tobytes(), check=True, capture_output=True).stdout
    ref = ctypes.create_string_buffer(n * k // 256 * block)
    base.quantize_row_q8_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for r in range(n):
        row = np.ascontiguousarray(x[r])
        base.quantize_row_q8_K_ref(row.ctypes.data, ctypes.addressof(ref) + r * k // 256 * block, k)
    ours_blocks = np.frombuffer(ours, np.uint8).reshape(-1, block)
    ref_blocks = np.frombuffer(ref.raw, np.uint8).reshape(-1, block)
    zero = np.all(x.reshape(-1, 256) == 0, axis=1)  # the reference leaves a zero block's sums unwritten
    assert np.array_equal(ours_blocks[~zero], ref_blocks[~zero])
    assert np.array_equal(ours_blocks[zero, :260], ref_blocks[zero, :260])


SCRIPT = HEADERS.parent / "install_llama_cpp.sh"


def _builds(tmp_path: Path, flags: str) -> list[set[str]]:
    """The builds install_llama_cpp.sh would try on a CPU with these /proc/cpuinfo flags, best first: each the set
    of ggml options it turns on."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c {flags}\n")
    env = {"SSR_CPUINFO": str(cpuinfo), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", str(SCRIPT), "--print-flags"], env=env, check=True, capture_output=True,
                         text=True).stdout
    return [{opt.removeprefix("-DGGML_").removesuffix("=ON") for opt in line.split()
             if opt.startswith("-DGGML_") and opt.endswith("=ON")} for line in out.splitlines()]


@pytest.mark.parametrize("flags, first", [
    # AMX: SSR's rows kernels beside ggml's tiles
    ("avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 amx_tile amx_int8 amx_bf16",
     {"AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16"}),
    # AVX-512 VNNI without AMX (Zen 4/5): SSR's rows kernels, built in ggml's AMX backend, no tiles
    ("avx512f avx512bw avx512vl avx512dq avx512vbmi avx512_vnni avx512_bf16",
     {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"}),
    # AVX-512 without VNNI (Skylake-X): ggml's kernels
    ("avx512f avx512bw avx512vl avx512dq", {"AVX512"}),
    # AVX-VNNI, no AVX-512 (Alder Lake and later clients), and AVX2 alone: ggml's kernels
    ("avx_vnni", {"AVX_VNNI"}),
    ("", set()),
])
def test_the_install_picks_the_build_for_the_cpu_flags(tmp_path, flags, first):
    """The first build for each CPU class, then the fallbacks: without AMX where the first has it, then portable."""
    base = {"AVX", "AVX2", "FMA", "F16C"}
    builds = _builds(tmp_path, flags)
    assert builds[0] == base | first
    assert builds[-1] == base  # the portable build, last
    if "AMX_INT8" in first:
        assert builds[1] == base | (first - {"AMX_TILE", "AMX_INT8", "AMX_BF16"})
    assert len(builds) == len({frozenset(b) for b in builds})
