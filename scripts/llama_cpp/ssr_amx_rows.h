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
// SSR_AMX_VNNI_ROWS=N (environment, read once) sends batches of more than N rows to ggml's AMX tiles (0: every
// batch), for a machine where the tiles measure faster; unset, every batch takes these kernels.

#pragma once

#include <climits>
#include <cstdlib>

template <typename TB> struct ssr_has_rows_kernel : std::integral_constant<bool,
    std::is_same<TB, block_q4_K>::value ||
    std::is_same<TB, block_q6_K>::value ||
    std::is_same<TB, block_q8_0>::value> {};

inline bool ssr_rows_type(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q8_0;
}

inline int ssr_rows_max() {
    static const int rows = [] {
        const char * env = getenv("SSR_AMX_VNNI_ROWS");
        return env ? atoi(env) : INT_MAX;  // measured: faster than the tiles at every batch up to 512 rows
    }();
    return rows;
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
        const int TILE_SIZE = TILE_N * sizeof(block_q4_K) + TILE_N * 4;
        const block_q8_K * RESTRICT A = static_cast<const block_q8_K *>(_A);
        const char * RESTRICT B = static_cast<const char *>(_B);

        const int offset_scales = (QK_K / 2) * TILE_N;
        const int offset_mins   = (QK_K / 2) * TILE_N +  8 * TILE_N;
        const int offset_d0     = (QK_K / 2) * TILE_N + 16 * TILE_N;
        const int offset_dmin   = (QK_K / 2) * TILE_N + 16 * TILE_N + TILE_N * sizeof(ggml_half);
        const __m512i lowMask = _mm512_set1_epi8(0xF);

        __m512 vc[ROWS][COLS];
        ssr_zero(vc);
        for (int i = 0; i < KB; ++i) {
            const int32_t * a32[ROWS];
            int32_t bsum_pairs[ROWS][4];  // the one-row kernel's va_bsum lanes 0..3: sums of bsums, as int16 pairs
            __m512 vd1[ROWS];
            for (int r = 0; r < ROWS; ++r) {
                const block_q8_K & a = A[r * KB + i];
                a32[r] = reinterpret_cast<const int32_t *>(a.qs);
                const __m256i q8sums = _mm256_loadu_si256((const __m256i *)a.bsums);
                const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
                _mm_storeu_si128((__m128i *)bsum_pairs[r], q8s);
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
                const __m512 vd0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b_ptr[col] + offset_d0)));
                for (int r = 0; r < ROWS; ++r) {
                    vc[r][col] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][col]), _mm512_mul_ps(vd0, vd1[r]), vc[r][col]);
                }
                __m512i acc_m[ROWS];
                for (int r = 0; r < ROWS; ++r) {
                    acc_m[r] = _mm512_setzero_si512();
                }
                for (int k = 0; k < 4; ++k) {
                    const __m512i vb = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(b_ptr[col] + offset_mins + k * 32)));
                    for (int r = 0; r < ROWS; ++r) {
                        acc_m[r] = _mm512_dpwssds_epi32(acc_m[r], _mm512_set1_epi32(bsum_pairs[r][k]), vb);
                    }
                }
                const __m512 vdmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b_ptr[col] + offset_dmin)));
                for (int r = 0; r < ROWS; ++r) {
                    vc[r][col] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(acc_m[r]), _mm512_mul_ps(vdmin, vd1[r]), vc[r][col]);
                }
            }
        }
        ssr_store(C, ldc, vc);
    }
};

template <int ROWS, int COLS>
struct ssr_rows_kernel<block_q6_K, ROWS, COLS> {
    static void apply(int KB, const void * RESTRICT _A, const void * RESTRICT _B, float * RESTRICT C, int ldc) {
        const int TILE_SIZE = TILE_N * sizeof(block_q6_K);
        const block_q8_K * RESTRICT A = static_cast<const block_q8_K *>(_A);
        const char * RESTRICT B = static_cast<const char *>(_B);

        const int offset_qh     = (QK_K / 2) * TILE_N;
        const int offset_scales = (QK_K / 2) * TILE_N + (QK_K / 4) * TILE_N;
        const int offset_d0     = (QK_K / 2) * TILE_N + (QK_K / 4) * TILE_N + 16 * TILE_N;
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
                    vc[r][col] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][col]), _mm512_mul_ps(vd0, vd1[r]), vc[r][col]);
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
        for (int i = begin; i < end; ++i) {
            const int batch_idx = i / NB;
            const int nb = i % NB;
            const char * A = (const char *)wdata + batch_idx * M * row_size_A;
            const char * B = (const char *)src0->data + ggml_batch_offset(src0, batch_idx, ne2)
                             + PACKED_INDEX(nb * COLS, 0, KB, TILE_SIZE);
            float * C = (float *)((char *)dst->data + ggml_batch_offset(dst, batch_idx, ne2)) + nb * BLOCK_N;
            for (int m = 0; m < M; m += ROWS) {
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
    }
}

// dst = src1 x src0 for 1..ssr_rows_max() rows where src0's type has a kernel above; false where it does not
// apply (the caller then runs ggml's AMX path). wdata holds src1's rows already quantized to the vec_dot type.
inline bool ssr_rows_mul_mat(const ggml_compute_params * params, const ggml_tensor * src0, ggml_tensor * dst,
                             const void * wdata, int M, int N, int K, int ldc, int64_t n_batch, int64_t ne2) {
    constexpr int COLS = 4;  // output columns a work item: 4 tiles of 16 (2 measured slower)
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
