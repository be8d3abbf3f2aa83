// SSR's matmul kernels for ggml's AMX backend (added to the vendored llama.cpp by scripts/install_llama_cpp.sh,
// included by ggml-cpu/amx/mmq.cpp just before ggml_backend_amx_mul_mat, which calls ssr_rows_mul_mat first).
//
// Why: ggml's AMX matmul runs one row through a VNNI kernel whose integer dot products form one dependency chain
// per tile of 16 columns, and every batch of two rows or more through AMX tiles, which for K-quants unpack every
// weight block into tile layout and rescale each 32-value group of every 16x16 tile with AVX-512 around each tile
// product. On a 2-vCPU Sapphire Rapids VM (Qwen2.5-Coder-1.5B Q4_K_M, 2 threads) a 2-row decode on the tiles cost
// 1.6 one-row decodes. These kernels are that one-row kernel with each weight block loaded and unpacked once for up
// to four rows and the dot products of four rows x four tiles (16 chains) interleaved: there a one-row decode takes
// 67 ms against 90 through ggml's kernel, four rows 1.3 one-row decodes, a 512-token prefill 6.0 ms a token against
// 6.7 on the tiles (docs/backends/llama-cpp.md). Each row's arithmetic is the one-row kernel's, operation for
// operation (integer dot products, exact in any order, then the same float multiply-adds in the same order), so a
// row's output has the bits it has when that row is decoded alone, through ggml's kernel or these.
//
// They need AVX-512 VNNI only: on a CPU without AMX (ssr_amx_cpu.h) they run every batch of their weight types.
// SSR_AMX_VNNI_ROWS=N (environment, read once) sends batches of more than N rows to ggml's AMX tiles (0: every
// batch), for a machine where the tiles measure faster; unset, every batch takes these kernels. Q4_K and Q6_K
// batches of 32 rows or more (SSR_AMX_TILE_ROWS) go through SSR's own AMX tile kernel below, with the same bits a row.

#pragma once

#include <climits>
#include <cstdlib>
#include <cstring>

#include "ssr_amx_cpu.h"

template <typename TB> struct ssr_has_rows_kernel : std::integral_constant<bool,
    std::is_same<TB, block_q4_K>::value ||
    std::is_same<TB, block_q6_K>::value ||
    std::is_same<TB, block_q8_0>::value> {};

// The most rows a batch may have to take these kernels (more go to ggml's AMX tiles): unset, every batch (measured
// faster than the tiles at every batch up to 512 rows); without AMX, every batch whatever the setting.
inline int ssr_rows_max() {
    return ssr_amx_tiles() ? ssr_rows_env() : INT_MAX;
}

// Accumulators of ROWS rows x COLS tiles of 16 output columns.
template <int ROWS, int COLS> void ssr_zero(__m512 (&v)[ROWS][COLS]) {
    for (int r = 0; r < ROWS; ++r) {
        for (int col = 0; col < COLS; ++col) {
            v[r][col] = _mm512_setzero_ps();
        }
    }
}

template <int ROWS, int COLS> void ssr_zero(__m512i (&v)[ROWS][COLS]) {
    for (int r = 0; r < ROWS; ++r) {
        for (int col = 0; col < COLS; ++col) {
            v[r][col] = _mm512_setzero_si512();
        }
    }
}

template <int ROWS, int COLS> void ssr_store(float * RESTRICT C, int ldc, const __m512 (&vc)[ROWS][COLS]) {
    for (int r = 0; r < ROWS; ++r) {
        for (int col = 0; col < COLS; ++col) {
            _mm512_storeu_ps(C + r * ldc + col * 16, vc[r][col]);
        }
    }
}

// Byte offsets in ggml's packed AMX tile of one block x 16 columns, per weight type (the one place they are spelt).
template <typename TB> struct ssr_packed;

template <> struct ssr_packed<block_q4_K> {  // 4-bit values, 6-bit scales, 6-bit mins, f16 d, f16 dmin
    static constexpr int SCALES = (QK_K / 2) * TILE_N, MINS = SCALES + 8 * TILE_N, D = SCALES + 16 * TILE_N;
    static constexpr int DMIN = D + TILE_N * sizeof(ggml_half), TILE_SIZE = TILE_N * sizeof(block_q4_K) + TILE_N * 4;
};

template <> struct ssr_packed<block_q6_K> {  // low 4 bits, high 2 bits, signed 8-bit scales, f16 d
    static constexpr int QH = (QK_K / 2) * TILE_N, SCALES = QH + (QK_K / 4) * TILE_N, D = SCALES + 16 * TILE_N;
    static constexpr int TILE_SIZE = TILE_N * sizeof(block_q6_K);
};

// A Q4_K block's float work for one row and one tile of 16 columns, shared by the rows kernel and the tile kernel
// so that both give a row the same bits: the block's integer sum (over groups, scale x dot product) times d x the
// row's scale added to vc, then the mins' integer sum (over groups, min x the row's bsums) times dmin x the row's
// scale subtracted. bsum_pairs: the row's bsums summed in pairs (ggml's one-row kernel's va_bsum lanes 0..3).
struct ssr_q4k_column {  // a packed block's per-column constants
    __m512 vd0, vdmin;
    __m512i vmins[4];
};

inline ssr_q4k_column ssr_q4k_load_column(const char * RESTRICT b) {
    using P = ssr_packed<block_q4_K>;
    ssr_q4k_column c;
    c.vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + P::D)));
    c.vdmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + P::DMIN)));
    for (int k = 0; k < 4; ++k) {
        c.vmins[k] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b + P::MINS + k * 32)));
    }
    return c;
}

inline void ssr_q4k_bsum_pairs(const block_q8_K & a, int32_t (&bsum_pairs)[4]) {
    const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a.bsums);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    _mm_storeu_si128((__m128i *)bsum_pairs, q8s);
}

inline __m512 ssr_q4k_block_out(__m512 vc, __m512i acc, const ssr_q4k_column & c, __m512 vd1,
                                const int32_t (&bsum_pairs)[4]) {
    vc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(c.vd0, vd1), vc);
    __m512i acc_m = _mm512_setzero_si512();
    for (int k = 0; k < 4; ++k) {
        acc_m = _mm512_dpwssds_epi32(acc_m, _mm512_set1_epi32(bsum_pairs[k]), c.vmins[k]);
    }
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(acc_m), _mm512_mul_ps(c.vdmin, vd1), vc);
}

// C[r][0..COLS*16) = A[r] x B for r < ROWS: A holds ROWS quantized rows of KB blocks each, B one packed block
// column (COLS tiles of 16 output columns), C rows ldc floats apart.
//
// The integer dot products of every row and tile run interleaved (ROWS x COLS independent accumulator chains, so
// the VNNI units are not left waiting on one chain's latency); integer sums are exact in any order, and the float
// multiply-adds keep the one-row kernel's order.
template <typename TB, int ROWS, int COLS> struct ssr_rows_kernel;

template <int ROWS, int COLS>
struct ssr_rows_kernel<block_q4_K, ROWS, COLS> {
    static void apply(int KB, const void * RESTRICT _A, const void * RESTRICT _B, float * RESTRICT C, int ldc) {
        const int TILE_SIZE = ssr_packed<block_q4_K>::TILE_SIZE;
        const block_q8_K * RESTRICT A = static_cast<const block_q8_K *>(_A);
        const char * RESTRICT B = static_cast<const char *>(_B);

        const int offset_scales = ssr_packed<block_q4_K>::SCALES;
        const __m512i lowMask = _mm512_set1_epi8(0xF);

        __m512 vc[ROWS][COLS];
        ssr_zero(vc);
        for (int i = 0; i < KB; ++i) {
            const int32_t * a32[ROWS];
            int32_t bsum_pairs[ROWS][4];
            __m512 vd1[ROWS];
            for (int r = 0; r < ROWS; ++r) {
                const block_q8_K & a = A[r * KB + i];
                a32[r] = reinterpret_cast<const int32_t *>(a.qs);
                ssr_q4k_bsum_pairs(a, bsum_pairs[r]);
                vd1[r] = _mm512_set1_ps(a.d);
            }
            const char * b_ptr[COLS];
            for (int col = 0; col < COLS; ++col) {
                b_ptr[col] = B + PACKED_INDEX(col, i, KB, TILE_SIZE);
            }
            __m512i acc[ROWS][COLS];
            ssr_zero(acc);
            for (int k_group = 0; k_group < QK_K / 32; ++k_group) {
                __m512i vsum[ROWS][COLS];
                ssr_zero(vsum);
                for (int k = 0; k < 8; k += 2) {
                    for (int col = 0; col < COLS; ++col) {
                        const __m512i bytes = _mm512_loadu_si512((const __m512i *)(b_ptr[col] + (k_group * 4 + k / 2) * 64));
                        const __m512i vb0 = _mm512_and_si512(bytes, lowMask);
                        const __m512i vb1 = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), lowMask);
                        for (int r = 0; r < ROWS; ++r) {
                            vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], vb0, _mm512_set1_epi32(a32[r][k_group * 8 + k]));
                            vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], vb1, _mm512_set1_epi32(a32[r][k_group * 8 + k + 1]));
                        }
                    }
                }
                for (int col = 0; col < COLS; ++col) {
                    const __m512i vscale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b_ptr[col] + offset_scales + k_group * TILE_N)));
                    for (int r = 0; r < ROWS; ++r) {
                        acc[r][col] = _mm512_add_epi32(acc[r][col], _mm512_mullo_epi32(vsum[r][col], vscale));
                    }
                }
            }
            for (int col = 0; col < COLS; ++col) {
                const ssr_q4k_column column = ssr_q4k_load_column(b_ptr[col]);
                for (int r = 0; r < ROWS; ++r) {
                    vc[r][col] = ssr_q4k_block_out(vc[r][col], acc[r][col], column, vd1[r], bsum_pairs[r]);
                }
            }
        }
        ssr_store(C, ldc, vc);
    }
};

// A Q6_K block's float work for one row and one tile of 16 columns (the rows kernel and the tile kernel alike).
inline __m512 ssr_q6k_block_out(__m512 vc, __m512i acc, __m512 vd0, __m512 vd1) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(vd0, vd1), vc);
}

template <int ROWS, int COLS>
struct ssr_rows_kernel<block_q6_K, ROWS, COLS> {
    static void apply(int KB, const void * RESTRICT _A, const void * RESTRICT _B, float * RESTRICT C, int ldc) {
        const int TILE_SIZE = ssr_packed<block_q6_K>::TILE_SIZE;
        const block_q8_K * RESTRICT A = static_cast<const block_q8_K *>(_A);
        const char * RESTRICT B = static_cast<const char *>(_B);

        const int offset_qh     = ssr_packed<block_q6_K>::QH;
        const int offset_scales = ssr_packed<block_q6_K>::SCALES;
        const int offset_d0     = ssr_packed<block_q6_K>::D;
        const __m512i lowMask = _mm512_set1_epi8(0xF);
        const __m512i hmask = _mm512_set1_epi8(0x3);

        __m512 vc[ROWS][COLS];
        ssr_zero(vc);
        for (int i = 0; i < KB; ++i) {
            const int32_t * a32[ROWS];
            int32_t comp[ROWS][16];  // 32 * bsums: the one-row kernel's vcomp
            __m512 vd1[ROWS];
            for (int r = 0; r < ROWS; ++r) {
                const block_q8_K & a = A[r * KB + i];
                a32[r] = reinterpret_cast<const int32_t *>(a.qs);
                const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a.bsums);
                _mm512_storeu_si512((__m512i *)comp[r], _mm512_mullo_epi32(_mm512_cvtepi16_epi32(q8sums), _mm512_set1_epi32(32)));
                vd1[r] = _mm512_set1_ps(a.d);
            }
            const char * b_ptr[COLS];
            for (int col = 0; col < COLS; ++col) {
                b_ptr[col] = B + PACKED_INDEX(col, i, KB, TILE_SIZE);
            }
            __m512i acc[ROWS][COLS];
            ssr_zero(acc);
            for (int k_group = 0; k_group < QK_K / 16; ++k_group) {
                __m512i vsum[ROWS][COLS];
                ssr_zero(vsum);
                for (int col = 0; col < COLS; ++col) {
                    const char * b_qs = b_ptr[col] + k_group * 128;
                    const __m512i hbits = _mm512_loadu_si512(b_ptr[col] + offset_qh + k_group * 64);
                    __m512i bytes = _mm512_loadu_si512(b_qs);
                    __m512i vb0 = _mm512_and_si512(bytes, lowMask);
                    __m512i vb1 = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), lowMask);
                    vb0 = _mm512_add_epi8(vb0, _mm512_slli_epi16(_mm512_and_si512(hbits, hmask), 4));
                    vb1 = _mm512_add_epi8(vb1, _mm512_slli_epi16(_mm512_and_si512(hbits, _mm512_slli_epi16(hmask, 2)), 2));
                    for (int r = 0; r < ROWS; ++r) {
                        vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], vb0, _mm512_set1_epi32(a32[r][k_group * 4 + 0]));
                        vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], vb1, _mm512_set1_epi32(a32[r][k_group * 4 + 1]));
                    }
                    bytes = _mm512_loadu_si512(b_qs + 64);
                    vb0 = _mm512_and_si512(bytes, lowMask);
                    vb1 = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), lowMask);
                    vb0 = _mm512_add_epi8(vb0, _mm512_and_si512(hbits, _mm512_slli_epi16(hmask, 4)));
                    vb1 = _mm512_add_epi8(vb1, _mm512_srli_epi16(_mm512_and_si512(hbits, _mm512_slli_epi16(hmask, 6)), 2));
                    for (int r = 0; r < ROWS; ++r) {
                        vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], vb0, _mm512_set1_epi32(a32[r][k_group * 4 + 2]));
                        vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], vb1, _mm512_set1_epi32(a32[r][k_group * 4 + 3]));
                    }
                }
                for (int col = 0; col < COLS; ++col) {
                    const __m512i vscale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b_ptr[col] + offset_scales + k_group * TILE_N)));
                    for (int r = 0; r < ROWS; ++r) {
                        const __m512i vs = _mm512_sub_epi32(vsum[r][col], _mm512_set1_epi32(comp[r][k_group]));
                        acc[r][col] = _mm512_add_epi32(acc[r][col], _mm512_mullo_epi32(vs, vscale));
                    }
                }
            }
            for (int col = 0; col < COLS; ++col) {
                const __m512 vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b_ptr[col] + offset_d0)));
                for (int r = 0; r < ROWS; ++r) {
                    vc[r][col] = ssr_q6k_block_out(vc[r][col], acc[r][col], vd0, vd1[r]);
                }
            }
        }
        ssr_store(C, ldc, vc);
    }
};

template <int ROWS, int COLS>
struct ssr_rows_kernel<block_q8_0, ROWS, COLS> {
    static void apply(int KB, const void * RESTRICT _A, const void * RESTRICT _B, float * RESTRICT C, int ldc) {
        const int TILE_SIZE = TILE_N * sizeof(block_q8_0) + TILE_N * sizeof(int32_t);
        const block_q8_0 * RESTRICT A = static_cast<const block_q8_0 *>(_A);
        const char * RESTRICT B = static_cast<const char *>(_B);
        const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));  // s8 x s8 as (a + 128) x b - 128 x b

        __m512 vc[ROWS][COLS];
        ssr_zero(vc);
        for (int i = 0; i < KB; ++i) {
            const int32_t * a32[ROWS];
            __m512 vd1[ROWS];
            for (int r = 0; r < ROWS; ++r) {
                a32[r] = reinterpret_cast<const int32_t *>(A[r * KB + i].qs);
                vd1[r] = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(A[r * KB + i].d));
            }
            const char * b_ptr[COLS];
            for (int col = 0; col < COLS; ++col) {
                b_ptr[col] = B + PACKED_INDEX(col, i, KB, TILE_SIZE);
            }
            __m512i vsum[ROWS][COLS];
            ssr_zero(vsum);
            for (int k = 0; k < 8; ++k) {
                for (int col = 0; col < COLS; ++col) {
                    const __m512i vb = _mm512_loadu_si512((const __m512i *)(b_ptr[col] + k * 64));
                    for (int r = 0; r < ROWS; ++r) {
                        vsum[r][col] = _mm512_dpbusd_epi32(vsum[r][col], _mm512_add_epi8(_mm512_set1_epi32(a32[r][k]), off), vb);
                    }
                }
            }
            for (int col = 0; col < COLS; ++col) {
                const __m512 vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b_ptr[col] + TILE_N * TILE_K)));
                const __m512i vcomp = _mm512_loadu_si512((const __m512i *)(b_ptr[col] + TILE_N * TILE_K + TILE_N * sizeof(ggml_half)));
                for (int r = 0; r < ROWS; ++r) {
                    const __m512i vs = _mm512_sub_epi32(vsum[r][col], vcomp);
                    vc[r][col] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(vs), _mm512_mul_ps(vd0, vd1[r]), vc[r][col]);
                }
            }
        }
        ssr_store(C, ldc, vc);
    }
};

// AMX tiles for batches of SSR_AMX_TILE_ROWS rows or more (unset: 32; 0: never) of Q4_K and Q6_K weights: 16 rows
// at a time, each 64 values of a block in tile products whose B tiles carry the group scales, split so that every
// product stays within a byte (Q4_K: two parts, ssr_q4k_scaled_tiles; Q6_K: four, ssr_q6k_scaled_tiles). Their sums,
// shifted and added, are integer for integer the rows kernel's sum over groups of scale x dot product; the block's
// float operations are then the rows kernel's own (ssr_q4k_block_out, ssr_q6k_block_out), so every row keeps the bits
// it has decoded alone (tests/test_llama_cpp_kernels.py). ggml's own AMX path applies each group's scale with AVX-512
// after a tile product per 32 values. Measured in the model (the 1.5B on the Xeon VM of docs/backends/llama-cpp.md,
// 2 threads), both types on tiles: a 128-token prefill 0.35-0.37 s against 0.56-0.60 through the rows kernels
// (0.40-0.42 with Q4_K alone on tiles), 600 tokens 1.95-2.06 s against 2.8-2.9 (2.06-2.21), a 64-row step
// 0.35-0.36 s against 0.47-0.51 (0.40-0.42); at 16 and 24 rows (one group of 16, the rest through the rows kernel)
// the tiles were 5-15% slower, at 32 rows 10-15% faster: hence 32.
inline int ssr_tiles_min() {
    static const int rows = [] {
        const char * env = getenv("SSR_AMX_TILE_ROWS");
        const int n = env && *env ? atoi(env) : 32;  // set but empty: as unset
        return n > 0 && ssr_amx_tiles() ? n : INT_MAX;  // never without AMX
    }();
    return rows;
}

struct ssr_tile_config {
    uint8_t palette_id = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};

inline void ssr_tile_load_config(const ssr_tile_config & tc) {
    __asm__ volatile("ldtilecfg %0" : : "m"(tc));  // the whole config as operand (install_llama_cpp.sh's first patch)
}

// Every tile 16 rows of 64 bytes: activations (16 rows x 64 values), scaled weights (16 rows of 16 columns x 4
// values) or sums (16 rows x 16 int32); which tile holds what is each weight type's (ssr_tile_kind::products).
inline void ssr_tiles_configure() {
    alignas(64) ssr_tile_config tc;
    for (int t = 0; t < 8; ++t) {
        tc.rows[t] = 16;
        tc.colsb[t] = 64;
    }
    ssr_tile_load_config(tc);
}

// ggml's own tile config (ggml_tile_config_init, which loads it once a thread): put back after SSR's tiles ran, so
// that ggml's AMX path finds the config it loaded.
inline void ssr_tiles_restore() {
    alignas(64) ssr_tile_config tc;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    for (int t = 4; t < 8; ++t) {
        tc.rows[t] = 16;  tc.colsb[t] = 64;
    }
    ssr_tile_load_config(tc);
}

// GCC's tile intrinsics are asm statements that name no memory: without a barrier the compiler may drop or move the
// vector stores a tile load reads and the vector loads of what a tile store wrote (seen at -O3).
#define SSR_TILE_MEMORY() __asm__ volatile("" ::: "memory")

constexpr int SSR_TILE_BYTES = 16 * 64;  // one B tile: 16 rows of 64 bytes

// The B tiles of values [64 c, 64 c + 64) of a packed Q4_K block: each value (0..15) times the low three bits of
// its group's scale (lo) and times the high three (hi). A 16-bit lane holds two values of one column, so one 16-bit
// multiply by the column's scale part scales both (each product below 256: no carry between the bytes).
inline void ssr_q4k_scaled_tiles(int8_t * RESTRICT lo, int8_t * RESTRICT hi, const char * RESTRICT b, int c) {
    const __m512i lowMask = _mm512_set1_epi8(0xF);
    const __m512i seven = _mm512_set1_epi16(7);
    for (int g = 0; g < 2; ++g) {
        const int k_group = 2 * c + g;
        const __m512i s32 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + ssr_packed<block_q4_K>::SCALES + k_group * TILE_N)));
        const __m512i s16 = _mm512_or_si512(s32, _mm512_slli_epi32(s32, 16));
        const __m512i slo = _mm512_and_si512(s16, seven);
        const __m512i shi = _mm512_srli_epi16(s16, 3);
        for (int k = 0; k < 8; k += 2) {
            const __m512i bytes = _mm512_loadu_si512((const __m512i *)(b + (k_group * 4 + k / 2) * 64));
            const __m512i v0 = _mm512_and_si512(bytes, lowMask);
            const __m512i v1 = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), lowMask);
            const int row = g * 8 + k;  // tile row: 4 values of each column, in the activations' order
            _mm512_store_si512((__m512i *)(lo + row * 64), _mm512_mullo_epi16(v0, slo));
            _mm512_store_si512((__m512i *)(lo + (row + 1) * 64), _mm512_mullo_epi16(v1, slo));
            _mm512_store_si512((__m512i *)(hi + row * 64), _mm512_mullo_epi16(v0, shi));
            _mm512_store_si512((__m512i *)(hi + (row + 1) * 64), _mm512_mullo_epi16(v1, shi));
        }
    }
}

// The B tiles of values [64 c, 64 c + 64) of a packed Q6_K block: the products of each value v = u - 32 (u its six
// bits) and its group's scale s (signed 8-bit), in four int8 parts: v = vl + 16 vh (vl = u & 15: 0..15, vh = (u >> 4)
// - 2: -2..1) and s = sl + 16 sh (sl = s & 15: 0..15, sh = s >> 4: -8..7) give v s = vl sl + 16 (vl sh + vh sl) +
// 256 vh sh; t0 = vl sl (0..225: unsigned, for tdpbsud), t1 = vl sh, t2 = vh sl, t3 = vh sh (signed, within int8).
// The signed parts are made from unsigned products (sh + 8 is 0..15) less their offsets, byte by byte modulo 256:
// exact because each true value fits a byte.
inline void ssr_q6k_scaled_tiles(int8_t * RESTRICT t0, int8_t * RESTRICT t1, int8_t * RESTRICT t2,
                                 int8_t * RESTRICT t3, const char * RESTRICT b, int c) {
    const int offset_qh = ssr_packed<block_q6_K>::QH, offset_scales = ssr_packed<block_q6_K>::SCALES;
    const __m512i low = _mm512_set1_epi8(0xF), three = _mm512_set1_epi8(0x3);
    for (int g = 0; g < 4; ++g) {
        const int k_group = 4 * c + g;
        const __m512i x32 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + offset_scales + k_group * TILE_N)));
        const __m512i sl32 = _mm512_and_si512(x32, _mm512_set1_epi32(15));
        const __m512i sh32 = _mm512_xor_si512(_mm512_srli_epi32(x32, 4), _mm512_set1_epi32(8));  // sh + 8
        const __m512i sl16 = _mm512_or_si512(sl32, _mm512_slli_epi32(sl32, 16));  // per 16-bit lane
        const __m512i sh16 = _mm512_or_si512(sh32, _mm512_slli_epi32(sh32, 16));
        const __m512i sl2 = _mm512_slli_epi16(_mm512_or_si512(sl16, _mm512_slli_epi16(sl16, 8)), 1);  // 2 sl a byte
        const __m512i sh2 = _mm512_sub_epi8(_mm512_slli_epi16(_mm512_or_si512(sh16, _mm512_slli_epi16(sh16, 8)), 1),
                                            _mm512_set1_epi8(16));  // 2 sh a byte
        const __m512i hbits = _mm512_loadu_si512(b + offset_qh + k_group * 64);
        for (int q = 0; q < 4; ++q) {
            const __m512i bytes = _mm512_loadu_si512(b + k_group * 128 + (q / 2) * 64);
            const __m512i vl = _mm512_and_si512(q % 2 ? _mm512_srli_epi16(bytes, 4) : bytes, low);
            const __m512i uh = _mm512_and_si512(_mm512_srli_epi16(hbits, 2 * q), three);  // vh + 2
            const int row = g * 4 + q;  // tile row: values 4 q .. 4 q + 3 of group g, 16 columns
            _mm512_store_si512((__m512i *)(t0 + row * 64), _mm512_mullo_epi16(vl, sl16));
            _mm512_store_si512((__m512i *)(t1 + row * 64),
                               _mm512_sub_epi8(_mm512_mullo_epi16(vl, sh16), _mm512_slli_epi16(vl, 3)));
            _mm512_store_si512((__m512i *)(t2 + row * 64), _mm512_sub_epi8(_mm512_mullo_epi16(uh, sl16), sl2));
            _mm512_store_si512((__m512i *)(t3 + row * 64),
                               _mm512_sub_epi8(_mm512_sub_epi8(_mm512_mullo_epi16(uh, sh16), _mm512_slli_epi16(uh, 3)), sh2));
        }
    }
}

// What the tile driver below needs of a weight type: how many B tiles a block's column takes
// (made once, for every group of 16 rows), the tile products of one group, and each row's float work.
template <typename TB> struct ssr_tile_kind;

template <> struct ssr_tile_kind<block_q4_K> {
    static constexpr int B_TILES = 8;  // 4 chunks of 64 values x (lo, hi)
    static constexpr int SUMS = 2;     // lo, hi
    using column = ssr_q4k_column;

    static void make_tiles(int8_t * RESTRICT tiles, const char * RESTRICT b) {
        for (int c = 0; c < 4; ++c) {
            ssr_q4k_scaled_tiles(tiles + 2 * c * SSR_TILE_BYTES, tiles + (2 * c + 1) * SSR_TILE_BYTES, b, c);
        }
    }
    static column load_column(const char * RESTRICT b) { return ssr_q4k_load_column(b); }

    // sums[0] = the products with the scales' low bits, sums[1] with their high bits, two chunks at a time on two
    // sets of tiles
    static void products(const int8_t * a, int stride, const int8_t * tiles, int32_t (*sums)[256]) {
        _tile_zero(3);
        _tile_zero(4);
        for (int c = 0; c < 4; c += 2) {
            _tile_loadd(0, a + c * 64, stride);
            _tile_loadd(1, tiles + (2 * c) * SSR_TILE_BYTES, 64);
            _tile_loadd(2, tiles + (2 * c + 1) * SSR_TILE_BYTES, 64);
            _tile_dpbssd(3, 0, 1);
            _tile_dpbssd(4, 0, 2);
            _tile_loadd(5, a + (c + 1) * 64, stride);
            _tile_loadd(6, tiles + (2 * c + 2) * SSR_TILE_BYTES, 64);
            _tile_loadd(7, tiles + (2 * c + 3) * SSR_TILE_BYTES, 64);
            _tile_dpbssd(3, 5, 6);
            _tile_dpbssd(4, 5, 7);
        }
        _tile_stored(3, sums[0], 64);
        _tile_stored(4, sums[1], 64);
    }

    static __m512 row_out(__m512 vc, const int32_t (*sums)[256], int r, const column & c, const block_q8_K & a) {
        const __m512i acc = _mm512_add_epi32(_mm512_load_si512((const __m512i *)(sums[0] + r * 16)),
                                             _mm512_slli_epi32(_mm512_load_si512((const __m512i *)(sums[1] + r * 16)), 3));
        int32_t bsum_pairs[4];
        ssr_q4k_bsum_pairs(a, bsum_pairs);
        return ssr_q4k_block_out(vc, acc, c, _mm512_set1_ps(a.d), bsum_pairs);
    }
};

template <> struct ssr_tile_kind<block_q6_K> {
    static constexpr int B_TILES = 16;  // 4 chunks of 64 values x (t0, t1, t2, t3)
    static constexpr int SUMS = 3;      // t0; t1 + t2; t3
    using column = __m512;              // the block's d, 16 columns

    static void make_tiles(int8_t * RESTRICT tiles, const char * RESTRICT b) {
        for (int c = 0; c < 4; ++c) {
            int8_t * t = tiles + 4 * c * SSR_TILE_BYTES;
            ssr_q6k_scaled_tiles(t, t + SSR_TILE_BYTES, t + 2 * SSR_TILE_BYTES, t + 3 * SSR_TILE_BYTES, b, c);
        }
    }
    static column load_column(const char * RESTRICT b) {
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + ssr_packed<block_q6_K>::D)));
    }

    // sums[0] = A x t0 (unsigned weights), sums[1] = A x t1 + A x t2, sums[2] = A x t3: every tile in use
    static void products(const int8_t * a, int stride, const int8_t * tiles, int32_t (*sums)[256]) {
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(7);
        for (int c = 0; c < 4; ++c) {
            const int8_t * t = tiles + 4 * c * SSR_TILE_BYTES;
            _tile_loadd(0, a + c * 64, stride);
            _tile_loadd(1, t, 64);
            _tile_loadd(2, t + SSR_TILE_BYTES, 64);
            _tile_loadd(5, t + 2 * SSR_TILE_BYTES, 64);
            _tile_loadd(6, t + 3 * SSR_TILE_BYTES, 64);
            _tile_dpbsud(3, 0, 1);
            _tile_dpbssd(4, 0, 2);
            _tile_dpbssd(4, 0, 5);
            _tile_dpbssd(7, 0, 6);
        }
        _tile_stored(3, sums[0], 64);
        _tile_stored(4, sums[1], 64);
        _tile_stored(7, sums[2], 64);
    }

    static __m512 row_out(__m512 vc, const int32_t (*sums)[256], int r, const column & vd0, const block_q8_K & a) {
        const __m512i acc = _mm512_add_epi32(
            _mm512_load_si512((const __m512i *)(sums[0] + r * 16)),
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const __m512i *)(sums[1] + r * 16)), 4),
                             _mm512_slli_epi32(_mm512_load_si512((const __m512i *)(sums[2] + r * 16)), 8)));
        return ssr_q6k_block_out(vc, acc, vd0, _mm512_set1_ps(a.d));
    }
};

// C[r][0..16 cols) = A[r] x B for r < M, B cols packed tile columns of TB from block 0 (tiles configured for 16
// rows). Each block's scaled weight tiles are made once and serve every group of 16 rows; the rows' float sums
// accumulate in C from block to block (stored and loaded: the same bits as kept in registers). A last group of
// fewer than 16 rows reads its activations from a copy padded with zeros.
template <typename TB>
inline void ssr_tiles(int KB, const block_q8_K * RESTRICT A, int M, const char * RESTRICT B, int cols,
                      float * RESTRICT C, int ldc) {
    using kind = ssr_tile_kind<TB>;
    const int lda = KB * sizeof(block_q8_K);
    alignas(64) int8_t tiles[kind::B_TILES * SSR_TILE_BYTES];
    alignas(64) int8_t padded[16 * QK_K];  // the last group's activations of one block, 16 rows
    alignas(64) int32_t sums[kind::SUMS][256];
    for (int i = 0; i < KB; ++i) {  // blocks outer: a block's activations, read for every column, stay in cache
        for (int col = 0; col < cols; ++col) {
            const char * b = B + PACKED_INDEX(col, i, KB, ssr_packed<TB>::TILE_SIZE);
            kind::make_tiles(tiles, b);
            const typename kind::column column = kind::load_column(b);
            for (int m = 0; m < M; m += 16) {
                const int nr = std::min(16, M - m);
                const block_q8_K * Am = A + (size_t)m * KB;
                const int8_t * a = Am[i].qs;
                int stride = lda;
                if (nr < 16) {
                    for (int r = 0; r < 16; ++r) {
                        if (r < nr) {
                            memcpy(padded + r * QK_K, Am[r * KB + i].qs, QK_K);
                        } else {
                            memset(padded + r * QK_K, 0, QK_K);
                        }
                    }
                    a = padded;
                    stride = QK_K;
                }
                // the next group's activations of this block, fetched while this group computes: a tile load
                // waits for each of its 16 rows, lines the hardware prefetcher does not follow from row to row
                // (the perf samples sat on these loads; the prefetch's own gain was not measured apart)
                for (int r = 0; r < std::min(16, M - m - 16); ++r) {
                    const int8_t * next = Am[(16 + r) * KB + i].qs;
                    for (int k = 0; k < QK_K; k += 64) {
                        _mm_prefetch((const char *)next + k, _MM_HINT_T0);
                    }
                }
                SSR_TILE_MEMORY();
                kind::products(a, stride, tiles, sums);
                SSR_TILE_MEMORY();
                for (int r = 0; r < nr; ++r) {  // the rows kernel's float work, row by row (the same function)
                    float * out = C + (size_t)(m + r) * ldc + col * 16;
                    const __m512 vc = i == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out);
                    _mm512_storeu_ps(out, kind::row_out(vc, sums, r, column, Am[r * KB + i]));
                }
            }
        }
    }
}

// The work items [begin, end) of ssr_rows_mul_mat for weights of type TB (a template, so that the types without a
// kernel above compile to nothing).
template <typename TB, typename TA, int BLCK_SIZE, int ROWS, int COLS>
void ssr_rows_work(int begin, int end, const ggml_tensor * src0, ggml_tensor * dst, const void * wdata,
                   int M, int N, int K, int ldc, int64_t ne2) {
    if constexpr (ssr_has_rows_kernel<TB>::value) {
        constexpr int BLOCK_N = TILE_N * COLS;
        const int NB = N / BLOCK_N;
        const int KB = K / BLCK_SIZE;
        const int TILE_SIZE = get_tile_size<TB>();
        const int row_size_A = KB * sizeof(TA);
        constexpr bool has_tiles = std::is_same<TB, block_q4_K>::value || std::is_same<TB, block_q6_K>::value;
        const bool tiles = has_tiles && M >= ssr_tiles_min();
        if (tiles) {
            ssr_tiles_configure();
        }
        for (int i = begin; i < end; ++i) {
            const int batch_idx = i / NB;
            const int nb = i % NB;
            const char * A = (const char *)wdata + batch_idx * M * row_size_A;
            const char * B = (const char *)src0->data + ggml_batch_offset(src0, batch_idx, ne2)
                             + PACKED_INDEX(nb * COLS, 0, KB, TILE_SIZE);
            float * C = (float *)((char *)dst->data + ggml_batch_offset(dst, batch_idx, ne2)) + nb * BLOCK_N;
            int m = 0;
            if constexpr (has_tiles) {
                if (tiles) {  // groups of 16 rows, the last one the rest where that is at least ssr_tiles_min()
                    m = M % 16 >= ssr_tiles_min() ? M : M / 16 * 16;
                    ssr_tiles<TB>(KB, (const block_q8_K *)A, m, B, COLS, C, ldc);
                }
            }
            for (; m < M; m += ROWS) {
                const char * Am = A + m * row_size_A;
                float * Cm = C + m * ldc;
                switch (std::min(ROWS, M - m)) {
                    case 1: ssr_rows_kernel<TB, 1, COLS>::apply(KB, Am, B, Cm, ldc); break;
                    case 2: ssr_rows_kernel<TB, 2, COLS>::apply(KB, Am, B, Cm, ldc); break;
                    case 3: ssr_rows_kernel<TB, 3, COLS>::apply(KB, Am, B, Cm, ldc); break;
                    default: ssr_rows_kernel<TB, 4, COLS>::apply(KB, Am, B, Cm, ldc); break;
                }
            }
        }
        if (tiles) {
            ssr_tiles_restore();
        }
    }
}

// dst = src1 x src0 for 1..ssr_rows_max() rows where src0's type has a kernel above; false where it does not
// apply (the caller then runs ggml's AMX path). wdata holds src1's rows already quantized to the vec_dot type.
inline bool ssr_rows_mul_mat(const ggml_compute_params * params, const ggml_tensor * src0, ggml_tensor * dst,
                             const void * wdata, int M, int N, int K, int ldc, int64_t n_batch, int64_t ne2) {
    constexpr int COLS = 4;  // output columns a work item: 4 tiles of 16 (2 measured slower)
    static_assert(TILE_N * COLS == SSR_ROWS_COLUMNS, "ssr_amx_cpu.h names the widths these kernels take");
    constexpr int ROWS = 4;  // rows sharing each unpacked weight block
    const enum ggml_type TYPE = src0->type;
    if (M < 1 || M > ssr_rows_max() || !ssr_rows_type(TYPE) || N % (TILE_N * COLS) != 0) {
        return false;
    }
    parallel_for_ggml(params, n_batch * (N / (TILE_N * COLS)), [&](int begin, int end) {
        GGML_DISPATCH_QTYPES(TYPE, [&] {
            ssr_rows_work<type, vec_dot_type, blck_size, ROWS, COLS>(begin, end, src0, dst, wdata, M, N, K, ldc, ne2);
        });
    });
    return true;
}
