// SSR's rows kernels for x86 CPUs without SSR's AVX-512 layout (AVX2; AVX-VNNI and AVX-512 VNNI where built for),
// on ggml's own weight layout (included by ggml-cpu/ggml-cpu.c, called by ggml_compute_forward_mul_mat in exact
// mode: the CPU backend's use_ref, which SSR sets with GGML_CPU_USE_REF).
//
// Why: in exact mode every row must have the bits it has when decoded alone, in any batch. ggml's per-row path
// (vec_dot, one weight row x one token at a time) keeps them, but unpacks and converts every weight block again for
// every token, so each further row of a batch costs nearly a whole one-row step of arithmetic; its multi-row paths
// (llamafile's tinyBLAS, the tiled K-quant kernels, CPU repacking) share that work but round a row differently with
// the batch. These kernels are ggml's AVX2 vec_dot for Q8_0, Q4_K and Q6_K, operation for operation per weight row
// and token, with each weight block loaded and unpacked once for up to eight tokens; a lone token runs vec_dot
// itself. What stays per token is most of a row's cost on AVX2 (sign, two multiply-adds, a float multiply-add a
// block): a further row costs a third to half of a one-row step (docs/backends/llama-cpp.md#costs-per-machine-class).
// Integer dot products are exact in any order and each (weight row, token) keeps its own float accumulator, updated
// in block order with vec_dot's multiply-adds and reduced with its horizontal sum: a row has vec_dot's bits, the bits
// it has alone, whatever else is in the batch.
//
// The second half of this file holds SSR's eight-row layouts for the same weight types and their kernels (patch
// 0008 registers them in ggml's CPU repack buffer: ssr_rows_x86_layout.h), which share the per-token arithmetic
// among eight weight rows too; where exact mode loads them, they take every matmul of those weights and the kernels
// above take none.
//
// SSR_X86_ROWS=0 (environment, read once) turns both off: exact mode then runs ggml's vec_dot for every row.

#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#include <immintrin.h>
#include <stdbool.h>
#include <stdlib.h>

#define SSR_X86_TOKENS 8  // tokens a weight block is unpacked for (8 against 4: 10-15% off 8 and 16 tokens)

static inline bool ssr_x86_rows_on(void) {
    static int on = -1;
    if (on < 0) {
        const char * env = getenv("SSR_X86_ROWS");
        on = env == NULL || atoi(env) != 0;
    }
    return on;
}

// ggml's hsum_float_8 (arch/x86/quants.c): the one-row kernel's final reduction, the same order.
static inline float ssr_x86_hsum(__m256 x) {
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// acc plus, per 32-bit lane, the sum of four products of unsigned ax and signed sy bytes (lane k: bytes 4k..4k+3).
static inline __m256i ssr_x86_dot_us8(__m256i acc, __m256i ax, __m256i sy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, ax, sy);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, ax, sy);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy)));
#endif
}

// Q8_0 weights (one row) x Q8_0 tokens: ggml_vec_dot_q8_0_q8_0's AVX2 path per token. (Two weight rows a group
// measured slower from two to four tokens: 21.5 ms against 17.1 for two tokens over 148 MB on one Zen 4 thread.)
static inline __attribute__((always_inline)) void ssr_x86_q8_0(int T, int nb, const char * w, const char * y,
                                                               size_t y_stride, float * out, size_t out_stride) {
    __m256 acc[SSR_X86_TOKENS];
    for (int t = 0; t < T; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const block_q8_0 * x = (const block_q8_0 *)w + ib;
        const float dx = GGML_CPU_FP16_TO_FP32(x->d);
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x->qs);
        const __m256i ax = _mm256_sign_epi8(qx, qx);
        for (int t = 0; t < T; ++t) {
            const block_q8_0 * b = (const block_q8_0 *)(y + t * y_stride) + ib;
            const __m256i qy = _mm256_loadu_si256((const __m256i *)b->qs);
            const __m256i sumi = ssr_x86_dot_us8(_mm256_setzero_si256(), ax, _mm256_sign_epi8(qy, qx));
            const __m256 q = _mm256_cvtepi32_ps(sumi);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx * GGML_CPU_FP16_TO_FP32(b->d)), q, acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        out[t * out_stride] = ssr_x86_hsum(acc[t]);
    }
}

// The 16-bit scale pair 2i, 2i+1 of a Q4_K block's eight (ggml's get_scale_shuffle_k4), and the 8-bit scale pair of
// a Q6_K block's sixteen, each repeated over 8 bytes (ggml's get_scale_shuffle).
static inline __m256i ssr_x86_shuffle_k4(int i) {
    return _mm256_set1_epi16((short)((2 * i) | ((2 * i + 1) << 8)));
}

static inline __m128i ssr_x86_shuffle_k6(int i) {
    return _mm_set_epi64x(0x0101010101010101LL * (2 * i + 1), 0x0101010101010101LL * (2 * i));
}

// Q4_K weights (one row) x Q8_K tokens: ggml_vec_dot_q4_K_q8_K's AVX2 path per token.
static inline __attribute__((always_inline)) void ssr_x86_q4_K(int T, int nb, const char * w, const char * y,
                                                               size_t y_stride, float * out, size_t out_stride) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[SSR_X86_TOKENS];
    __m128 acc_m[SSR_X86_TOKENS];
    for (int t = 0; t < T; ++t) {
        acc[t] = _mm256_setzero_ps();
        acc_m[t] = _mm_setzero_ps();
    }
    for (int i = 0; i < nb; ++i) {
        const block_q4_K * x = (const block_q4_K *)w + i;
        uint32_t utmp[4];
        memcpy(utmp, x->scales, 12);
        utmp[3] = ((utmp[2] >> 4) & 0x0f0f0f0f) | (((utmp[1] >> 6) & 0x03030303) << 4);
        const uint32_t uaux = utmp[1] & 0x3f3f3f3f;
        utmp[1] = (utmp[2] & 0x0f0f0f0f) | (((utmp[0] >> 6) & 0x03030303) << 4);
        utmp[2] = uaux;
        utmp[0] &= 0x3f3f3f3f;
        const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
        const __m128i mins = _mm256_extracti128_si256(mins_and_scales, 1);
        const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
        const __m256i scales = _mm256_set_m128i(sc128, sc128);
        const ggml_half * dm = (const ggml_half *)x;  // d, dmin: the block's first halves (C++ names them apart)
        const float xd = GGML_CPU_FP16_TO_FP32(dm[0]), xdmin = GGML_CPU_FP16_TO_FP32(dm[1]);

        __m256i sumi[SSR_X86_TOKENS];
        for (int t = 0; t < T; ++t) {
            const block_q8_K * b = (const block_q8_K *)(y + t * y_stride) + i;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)b->bsums);
            const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0),
                                               _mm256_extracti128_si256(q8sums, 1));
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            acc_m[t] = _mm_fmadd_ps(_mm_set1_ps(-b->d * xdmin), _mm_cvtepi32_ps(prod), acc_m[t]);
            sumi[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < QK_K / 64; ++j) {
            const __m256i scale_l = _mm256_shuffle_epi8(scales, ssr_x86_shuffle_k4(2 * j + 0));
            const __m256i scale_h = _mm256_shuffle_epi8(scales, ssr_x86_shuffle_k4(2 * j + 1));
            const __m256i q4bits = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * j));
            const __m256i q4l = _mm256_and_si256(q4bits, m4);
            const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
            for (int t = 0; t < T; ++t) {
                const int8_t * q8 = ((const block_q8_K *)(y + t * y_stride) + i)->qs + 64 * j;
                const __m256i p16l = _mm256_madd_epi16(scale_l,
                    _mm256_maddubs_epi16(q4l, _mm256_loadu_si256((const __m256i *)q8)));
                const __m256i p16h = _mm256_madd_epi16(scale_h,
                    _mm256_maddubs_epi16(q4h, _mm256_loadu_si256((const __m256i *)(q8 + 32))));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p16l, p16h));
            }
        }
        for (int t = 0; t < T; ++t) {
            const float yd = ((const block_q8_K *)(y + t * y_stride) + i)->d;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(yd * xd), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        __m128 m = _mm_add_ps(acc_m[t], _mm_movehl_ps(acc_m[t], acc_m[t]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[t * out_stride] = ssr_x86_hsum(acc[t]) + _mm_cvtss_f32(m);
    }
}

// Q6_K weights (one row) x Q8_K tokens: ggml_vec_dot_q6_K_q8_K's AVX2 path per token.
static inline __attribute__((always_inline)) void ssr_x86_q6_K(int T, int nb, const char * w, const char * y,
                                                               size_t y_stride, float * out, size_t out_stride) {
    const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    __m256 acc[SSR_X86_TOKENS];
    for (int t = 0; t < T; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int i = 0; i < nb; ++i) {
        const block_q6_K * x = (const block_q6_K *)w + i;
        const __m128i scales = _mm_loadu_si128((const __m128i *)x->scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        const float xd = GGML_CPU_FP16_TO_FP32(x->d);
        __m256i sumi[SSR_X86_TOKENS];
        for (int t = 0; t < T; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < QK_K / 128; ++j) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * j));
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * j + 32));
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * j));
            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
            const __m256i q4_0 = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
            const __m256i q4_1 = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
            const __m256i q4_2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
            const __m256i q4_3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
            const __m256i sc0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, ssr_x86_shuffle_k6(4 * j + 0)));
            const __m256i sc1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, ssr_x86_shuffle_k6(4 * j + 1)));
            const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, ssr_x86_shuffle_k6(4 * j + 2)));
            const __m256i sc3 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, ssr_x86_shuffle_k6(4 * j + 3)));
            for (int t = 0; t < T; ++t) {
                const __m256i * q8 = (const __m256i *)(((const block_q8_K *)(y + t * y_stride) + i)->qs + 128 * j);
                const __m256i p0 = _mm256_madd_epi16(sc0, _mm256_maddubs_epi16(q4_0, _mm256_loadu_si256(q8 + 0)));
                const __m256i p1 = _mm256_madd_epi16(sc1, _mm256_maddubs_epi16(q4_1, _mm256_loadu_si256(q8 + 1)));
                const __m256i p2 = _mm256_madd_epi16(sc2, _mm256_maddubs_epi16(q4_2, _mm256_loadu_si256(q8 + 2)));
                const __m256i p3 = _mm256_madd_epi16(sc3, _mm256_maddubs_epi16(q4_3, _mm256_loadu_si256(q8 + 3)));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p0, p1));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p2, p3));
            }
        }
        for (int t = 0; t < T; ++t) {
            const block_q8_K * b = (const block_q8_K *)(y + t * y_stride) + i;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *)b->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            const float d = b->d * xd;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[t], q8sclsub)),
                                     acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        out[t * out_stride] = ssr_x86_hsum(acc[t]);
    }
}

// One weight row x T tokens (1..SSR_X86_TOKENS), the count made a constant so that the accumulators live in
// registers.
#define SSR_X86_CASE_T(CALL) \
    switch (T) { case 1: { enum { TT = 1 }; CALL; break; } case 2: { enum { TT = 2 }; CALL; break; } \
                 case 3: { enum { TT = 3 }; CALL; break; } case 4: { enum { TT = 4 }; CALL; break; } \
                 case 5: { enum { TT = 5 }; CALL; break; } case 6: { enum { TT = 6 }; CALL; break; } \
                 case 7: { enum { TT = 7 }; CALL; break; } default: { enum { TT = 8 }; CALL; break; } }

static inline void ssr_x86_row(enum ggml_type type, int T, int64_t k, const char * w, const char * y, size_t y_stride,
                               float * out, size_t out_stride) {
    switch (type) {
        case GGML_TYPE_Q8_0:
            SSR_X86_CASE_T(ssr_x86_q8_0(TT, (int)(k / QK8_0), w, y, y_stride, out, out_stride));
            break;
        case GGML_TYPE_Q4_K:
            SSR_X86_CASE_T(ssr_x86_q4_K(TT, (int)(k / QK_K), w, y, y_stride, out, out_stride));
            break;
        default:  // GGML_TYPE_Q6_K
            SSR_X86_CASE_T(ssr_x86_q6_K(TT, (int)(k / QK_K), w, y, y_stride, out, out_stride));
            break;
    }
}

// Whether these kernels take exact mode's matmul of src0 (weights) by src1: on (SSR_X86_ROWS), weights Q8_0 (the
// embedded models' Q5_0 rewritten too), Q4_K or Q6_K, activations in F32, one matrix (no broadcast batches).
static inline bool ssr_x86_rows_take(const struct ggml_tensor * src0, const struct ggml_tensor * src1) {
    const enum ggml_type type = src0->type;
    return ssr_x86_rows_on() && (type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) &&
           src1->type == GGML_TYPE_F32 && src0->ne[2] == 1 && src0->ne[3] == 1 && src1->ne[2] == 1 &&
           src1->ne[3] == 1;
}

// dst = src1 x src0^T for this thread's share of src0's rows, src1 already quantized into wdata (vec_dot_type rows
// of row_size bytes). Each thread takes a contiguous run of weight rows; each row meets the tokens eight at a time, so
// that its weights are read from memory once. A group of one token runs ggml's vec_dot itself (vec_dot: the weight
// type's), which gives the same bits.
static inline void ssr_x86_rows_mul_mat(const struct ggml_compute_params * params, const struct ggml_tensor * src0,
                                        struct ggml_tensor * dst, const char * wdata, size_t row_size,
                                        ggml_vec_dot_t vec_dot) {
    const int64_t n_w = src0->ne[1], n_y = dst->ne[1], k = src0->ne[0];
    const int64_t per_thread = (n_w + params->nth - 1) / params->nth;
    const int64_t w_start = MIN(per_thread * params->ith, n_w), w_end = MIN(w_start + per_thread, n_w);
    const size_t out_stride = dst->nb[1] / sizeof(float);
    for (int64_t r = w_start; r < w_end; ++r) {
        const char * w = (const char *)src0->data + r * src0->nb[1];
        for (int64_t t = 0; t < n_y; t += SSR_X86_TOKENS) {
            const int T = (int)MIN(SSR_X86_TOKENS, n_y - t);
            float * out = (float *)dst->data + t * out_stride + r;
            if (T == 1) {
                vec_dot((int)k, out, 0, w, 0, wdata + t * row_size, 0, 1);
            } else {
                ssr_x86_row(src0->type, T, k, w, wdata + t * row_size, row_size, out, out_stride);
            }
        }
    }
}

// SSR's layout for Q8_0 weights (ggml's CPU repack buffer in exact mode: ssr_rows_x86_layout.h, patch 0008): eight
// weight rows a group, block by block, their eight scales and then their values four at a time, row after row
// (qs[32 c + 4 r + j] is row r's value 4 c + j of the block). One 32-byte load holds four values of each of the
// eight rows, and one token's four values, broadcast, meet all of them in one multiply-add: a token's arithmetic
// per weight block falls from about nine instructions a row (ggml's vec_dot: loads, sign, two multiply-adds, the
// conversion, the float multiply-add and its scalar scale) to about five for eight rows' four values, and the block's
// integer sum goes to one float multiply-add, in the eight rows' lanes, with no horizontal sum at the end.
// Measured on one Zen 4 thread, a 148 MB matrix: one token 7.2-8.1 ms against vec_dot's 8.3-9.2, four tokens
// 11.5-12.5 against 19.3-19.6, eight 22.4-24.3 against 32.7-33.1 (docs/log.md, 2026-12-08).
//
// A row's result is its own blocks' exact integer sums, each scaled by its two scales and added in block order with
// one float multiply-add: nothing in it depends on the other tokens, so a token has the same bits in any batch (and
// the same bits at every SIMD level: the integer sums are exact, the float operations the same). They are not
// vec_dot's bits: in exact mode every batch of these weights, a single token included, runs this kernel.
typedef struct {
    ggml_half d[8];
    int8_t qs[8 * QK8_0];
} ssr_block_q8_0x8;

#define SSR_X86_LAYOUT_TOKENS 4  // tokens a group of rows meets at a time (its accumulators stay in registers)

// Eight rows x T tokens (1..SSR_X86_LAYOUT_TOKENS): out[t * out_stride + r] for row r of the group, token t.
static inline __attribute__((always_inline)) void ssr_x86_q8_0x8(int T, int nb, const ssr_block_q8_0x8 * w,
                                                                 const char * y, size_t y_stride, float * out,
                                                                 size_t out_stride) {
    __m256 acc[SSR_X86_LAYOUT_TOKENS];
    for (int t = 0; t < T; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const ssr_block_q8_0x8 * x = w + ib;
        __m256i sumi[SSR_X86_LAYOUT_TOKENS];
        for (int t = 0; t < T; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int c = 0; c < QK8_0 / 4; ++c) {
            const __m256i qx = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * c));
            const __m256i ax = _mm256_sign_epi8(qx, qx);
            for (int t = 0; t < T; ++t) {
                int32_t four;
                memcpy(&four, ((const block_q8_0 *)(y + t * y_stride) + ib)->qs + 4 * c, sizeof(four));
                sumi[t] = ssr_x86_dot_us8(sumi[t], ax, _mm256_sign_epi8(_mm256_set1_epi32(four), qx));
            }
        }
        const __m256 dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x->d));
        for (int t = 0; t < T; ++t) {
            const float dy = GGML_CPU_FP16_TO_FP32(((const block_q8_0 *)(y + t * y_stride) + ib)->d);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dx, _mm256_set1_ps(dy)), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        _mm256_storeu_ps(out + t * out_stride, acc[t]);
    }
}

// n_rows (a multiple of 8) rows of k values, ggml's Q8_0 blocks, into SSR's layout.
static inline void ssr_x86_repack_q8_0(int64_t n_rows, int64_t k, const block_q8_0 * src, ssr_block_q8_0x8 * dst) {
    const int64_t nb = k / QK8_0;
    for (int64_t g = 0; g < n_rows / 8; ++g) {
        for (int64_t ib = 0; ib < nb; ++ib) {
            ssr_block_q8_0x8 * out = dst + g * nb + ib;
            for (int r = 0; r < 8; ++r) {
                const block_q8_0 * x = src + (8 * g + r) * nb + ib;
                out->d[r] = x->d;
                for (int c = 0; c < QK8_0 / 4; ++c) {
                    memcpy(out->qs + 32 * c + 4 * r, x->qs + 4 * c, 4);
                }
            }
        }
    }
}

// SSR's layout for Q4_K weights: eight rows a group, block by block (256 values, eight sub-blocks of 32), the rows'
// d and dmin, their sub-blocks' 6-bit scales decoded (scales[j][r]) and mins decoded in pairs (mins[q][r]: sub-blocks
// 2q and 2q + 1), then the 4-bit values: for each pair of sub-blocks p and four values c, 32 bytes, row r's at 4 r,
// sub-block 2 p's values in the low nibbles and 2 p + 1's in the high (ggml's bytes, regrouped). The values are
// unsigned, so one multiply-add takes them with no sign operation, and eight of them add up in 16 bits before the
// sub-block's scale: about three instructions a token for eight rows' four values. 1184 bytes a group's block
// against ggml's 1152 (the scales decoded).
typedef struct {
    ggml_half d[8], dmin[8];
    uint8_t scales[8][8];
    uint8_t mins[4][8][2];
    uint8_t qs[4][8][32];
} ssr_block_q4_Kx8;


// Eight Q4_K rows x T Q8_K tokens (1..SSR_X86_LAYOUT_TOKENS), a sub-block at a time (one 16-bit sum a token). A row's result: the blocks' integer sums of scale x
// (values . token) in one float multiply-add each (acc), the mins' integer sums of min x (the token's sums of 32)
// in another (acc_m), then acc - acc_m.
static inline __attribute__((always_inline)) void ssr_x86_q4_Kx8(int T, int nb, const ssr_block_q4_Kx8 * w,
                                                                 const char * y, size_t y_stride, float * out,
                                                                 size_t out_stride) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m128i pairs = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // row r's scale in 2r, 2r+1
    __m256 acc[SSR_X86_LAYOUT_TOKENS], acc_m[SSR_X86_LAYOUT_TOKENS];
    for (int t = 0; t < T; ++t) {
        acc[t] = acc_m[t] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const ssr_block_q4_Kx8 * x = w + ib;
        __m256i sumi[SSR_X86_LAYOUT_TOKENS];
        for (int t = 0; t < T; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 8; ++j) {  // sub-block j: the low nibbles of pair j / 2 where j is even, else the high
            const int p = j / 2, shift = 4 * (j % 2);
            __m256i sum16[SSR_X86_LAYOUT_TOKENS];
            for (int t = 0; t < T; ++t) {
                sum16[t] = _mm256_setzero_si256();
            }
            for (int c = 0; c < 8; ++c) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)x->qs[p][c]);
                const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, shift), m4);
                for (int t = 0; t < T; ++t) {
                    int32_t four;
                    memcpy(&four, ((const block_q8_K *)(y + t * y_stride) + ib)->qs + 32 * j + 4 * c, sizeof(four));
                    sum16[t] = _mm256_add_epi16(sum16[t], _mm256_maddubs_epi16(v, _mm256_set1_epi32(four)));
                }
            }
            const __m256i sc = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)x->scales[j]),
                                                                     pairs));
            for (int t = 0; t < T; ++t) {
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(sum16[t], sc));
            }
        }
        const __m256 dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x->d));
        const __m256 dmx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x->dmin));
        for (int t = 0; t < T; ++t) {
            const block_q8_K * b = (const block_q8_K *)(y + t * y_stride) + ib;
            int32_t sums[4];  // the token's sums of its eight sub-blocks, in pairs of 16 bits
            _mm_storeu_si128((__m128i *)sums, _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)b->bsums),
                                                             _mm_loadu_si128((const __m128i *)b->bsums + 1)));
            __m256i summ = _mm256_setzero_si256();
            for (int q = 0; q < 4; ++q) {
                const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)x->mins[q]));
                summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mins, _mm256_set1_epi32(sums[q])));
            }
            const __m256 dy = _mm256_set1_ps(b->d);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dx, dy), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            acc_m[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmx, dy), _mm256_cvtepi32_ps(summ), acc_m[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        _mm256_storeu_ps(out + t * out_stride, _mm256_sub_ps(acc[t], acc_m[t]));
    }
}

// ggml's Q4_K 6-bit scales and mins of one block, decoded: sc[0..7], m[0..7] (ggml's get_scale_min_k4).
static inline void ssr_x86_q4_K_scales(const uint8_t * q, uint8_t * sc, uint8_t * m) {
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = q[j] & 63;
            m[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
            m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
}

// n_rows (a multiple of 8) rows of k values, ggml's Q4_K blocks, into SSR's layout.
static inline void ssr_x86_repack_q4_K(int64_t n_rows, int64_t k, const block_q4_K * src, ssr_block_q4_Kx8 * dst) {
    const int64_t nb = k / QK_K;
    for (int64_t g = 0; g < n_rows / 8; ++g) {
        for (int64_t ib = 0; ib < nb; ++ib) {
            ssr_block_q4_Kx8 * out = dst + g * nb + ib;
            for (int r = 0; r < 8; ++r) {
                const block_q4_K * x = src + (8 * g + r) * nb + ib;
                uint8_t sc[8], m[8];
                ssr_x86_q4_K_scales(x->scales, sc, m);
                memcpy(&out->d[r], x, sizeof(ggml_half));  // d, dmin: the block's first halves
                memcpy(&out->dmin[r], (const ggml_half *)x + 1, sizeof(ggml_half));
                for (int j = 0; j < 8; ++j) {
                    out->scales[j][r] = sc[j];
                    out->mins[j / 2][r][j % 2] = m[j];
                }
                for (int p = 0; p < 4; ++p) {
                    for (int c = 0; c < 8; ++c) {
                        memcpy(&out->qs[p][c][4 * r], x->qs + 32 * p + 4 * c, 4);
                    }
                }
            }
        }
    }
}

// SSR's layout for Q6_K weights: eight rows a group, block by block (256 values, sixteen groups of 16 with a signed
// scale each), the rows' d, their groups' scales (scales[g][r]), then group after group three vectors (q[g]): the
// values' low four bits in two (q[g][0]: values 0-3 of the group in the low nibbles, 4-7 in the high; q[g][1]: 8-11
// and 12-15; row r's four at 4 r) and their high two bits in one (q[g][2]: values i, 4 + i, 8 + i, 12 + i of row r in
// the bit pairs of byte 4 r + i), so that the kernel reads the block in order (high bits kept apart from the low
// ones, a second stream, read at a third of the speed at one token on a Zen 4). The six-bit values are unsigned
// (ggml's value + 32), so one multiply-add takes them with no sign operation and two add up in 16 bits before the
// group's scale; ggml's own 1680 bytes a group's block.
typedef struct {
    ggml_half d[8];
    int8_t scales[16][8];
    uint8_t q[16][3][32];
} ssr_block_q6_Kx8;

// Eight Q6_K rows x T Q8_K tokens (1..SSR_X86_LAYOUT_TOKENS). A row's result: per block, the integer sum over groups
// of scale x (values . token) less 32 x the sum of scale x the token's sums of 16, in one float multiply-add.
static inline __attribute__((always_inline)) void ssr_x86_q6_Kx8(int T, int nb, const ssr_block_q6_Kx8 * w,
                                                                 const char * y, size_t y_stride, float * out,
                                                                 size_t out_stride) {
    const __m256i m15 = _mm256_set1_epi8(0x0F), m48 = _mm256_set1_epi8(0x30);
    const __m128i pairs = _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // row r's scale in 2r, 2r+1
    __m256 acc[SSR_X86_LAYOUT_TOKENS];
    for (int t = 0; t < T; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int ib = 0; ib < nb; ++ib) {
        const ssr_block_q6_Kx8 * x = w + ib;
        __m256i sumi[SSR_X86_LAYOUT_TOKENS];
        for (int t = 0; t < T; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int g = 0; g < 16; ++g) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)x->q[g][0]);
            const __m256i b = _mm256_loadu_si256((const __m256i *)x->q[g][1]);
            const __m256i h = _mm256_loadu_si256((const __m256i *)x->q[g][2]);
            const __m256i q0 = _mm256_or_si256(_mm256_and_si256(a, m15), _mm256_and_si256(_mm256_slli_epi16(h, 4), m48));
            const __m256i q1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m15),
                                               _mm256_and_si256(_mm256_slli_epi16(h, 2), m48));
            const __m256i q2 = _mm256_or_si256(_mm256_and_si256(b, m15), _mm256_and_si256(h, m48));
            const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m15),
                                               _mm256_and_si256(_mm256_srli_epi16(h, 2), m48));
            const __m256i sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)x->scales[g]),
                                                                     pairs));
            for (int t = 0; t < T; ++t) {
                const int8_t * yq = ((const block_q8_K *)(y + t * y_stride) + ib)->qs + 16 * g;
                int32_t four[4];
                memcpy(four, yq, sizeof(four));
                const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, _mm256_set1_epi32(four[0])),
                                                     _mm256_maddubs_epi16(q1, _mm256_set1_epi32(four[1])));
                const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(q2, _mm256_set1_epi32(four[2])),
                                                     _mm256_maddubs_epi16(q3, _mm256_set1_epi32(four[3])));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_madd_epi16(s01, sc),
                                                                     _mm256_madd_epi16(s23, sc)));
            }
        }
        __m256i corr[SSR_X86_LAYOUT_TOKENS];  // sum over groups of scale x the token's sum of the group's 16
        for (int t = 0; t < T; ++t) {
            corr[t] = _mm256_setzero_si256();
        }
        for (int q = 0; q < 8; ++q) {
            const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(  // row r's scales of groups 2q, 2q+1
                _mm_loadl_epi64((const __m128i *)x->scales[2 * q]), _mm_loadl_epi64((const __m128i *)x->scales[2 * q + 1])));
            for (int t = 0; t < T; ++t) {
                int32_t bsums;
                memcpy(&bsums, ((const block_q8_K *)(y + t * y_stride) + ib)->bsums + 2 * q, sizeof(bsums));
                corr[t] = _mm256_add_epi32(corr[t], _mm256_madd_epi16(sc2, _mm256_set1_epi32(bsums)));
            }
        }
        const __m256 dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x->d));
        for (int t = 0; t < T; ++t) {
            const __m256 dy = _mm256_set1_ps(((const block_q8_K *)(y + t * y_stride) + ib)->d);
            const __m256i total = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(corr[t], 5));
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dx, dy), _mm256_cvtepi32_ps(total), acc[t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        _mm256_storeu_ps(out + t * out_stride, acc[t]);
    }
}

// ggml's Q6_K block as its 256 unsigned six-bit values (ggml's value + 32) in order (ggml's dequantize_row_q6_K).
static inline void ssr_x86_q6_K_values(const block_q6_K * x, uint8_t * q) {
    for (int half = 0; half < 2; ++half) {
        const uint8_t * ql = x->ql + 64 * half, * qh = x->qh + 32 * half;
        for (int l = 0; l < 32; ++l) {
            q[128 * half + l + 0] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
            q[128 * half + l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[128 * half + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[128 * half + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

// n_rows (a multiple of 8) rows of k values, ggml's Q6_K blocks, into SSR's layout.
static inline void ssr_x86_repack_q6_K(int64_t n_rows, int64_t k, const block_q6_K * src, ssr_block_q6_Kx8 * dst) {
    const int64_t nb = k / QK_K;
    for (int64_t g8 = 0; g8 < n_rows / 8; ++g8) {
        for (int64_t ib = 0; ib < nb; ++ib) {
            ssr_block_q6_Kx8 * out = dst + g8 * nb + ib;
            for (int r = 0; r < 8; ++r) {
                const block_q6_K * x = src + (8 * g8 + r) * nb + ib;
                uint8_t q[QK_K];
                ssr_x86_q6_K_values(x, q);
                out->d[r] = x->d;
                for (int g = 0; g < 16; ++g) {
                    const uint8_t * v = q + 16 * g;
                    out->scales[g][r] = x->scales[g];
                    for (int i = 0; i < 4; ++i) {
                        out->q[g][0][4 * r + i] = (uint8_t)((v[i] & 0xF) | ((v[4 + i] & 0xF) << 4));
                        out->q[g][1][4 * r + i] = (uint8_t)((v[8 + i] & 0xF) | ((v[12 + i] & 0xF) << 4));
                        out->q[g][2][4 * r + i] = (uint8_t)((v[i] >> 4) | ((v[4 + i] >> 4) << 2) |
                                                            ((v[8 + i] >> 4) << 4) | ((v[12 + i] >> 4) << 6));
                    }
                }
            }
        }
    }
}

// T tokens (1..4), the count made a constant so that the accumulators live in registers.
#define SSR_X86_CASE_T4(CALL) \
    switch (T) { case 1: { enum { TT = 1 }; CALL; break; } case 2: { enum { TT = 2 }; CALL; break; } \
                 case 3: { enum { TT = 3 }; CALL; break; } default: { enum { TT = 4 }; CALL; break; } }

// dst = src1 x src0^T for this thread's share of src0's rows (in SSR's layout for its type), src1 already quantized
// into wdata (vec_dot_type rows of row_size bytes, dst's rows in order). Each thread takes a contiguous run of groups
// of eight rows; each group meets the tokens a few at a time (its weights read from memory once, then from cache).
static inline void ssr_x86_layout_mul_mat(const struct ggml_compute_params * params, const struct ggml_tensor * src0,
                                          struct ggml_tensor * dst, const char * wdata, size_t row_size) {
    const enum ggml_type type = src0->type;
    const int64_t n_groups = src0->ne[1] / 8, n_y = dst->ne[1] * dst->ne[2] * dst->ne[3];
    const int64_t nb = src0->ne[0] / (type == GGML_TYPE_Q8_0 ? QK8_0 : QK_K);
    const int64_t per_thread = (n_groups + params->nth - 1) / params->nth;
    const int64_t g_start = MIN(per_thread * params->ith, n_groups), g_end = MIN(g_start + per_thread, n_groups);
    const size_t out_stride = dst->nb[1] / sizeof(float);
    for (int64_t g = g_start; g < g_end; ++g) {
        for (int64_t t = 0; t < n_y; t += SSR_X86_LAYOUT_TOKENS) {
            const int T = (int)MIN(SSR_X86_LAYOUT_TOKENS, n_y - t);
            float * out = (float *)dst->data + t * out_stride + 8 * g;
            const char * y = wdata + t * row_size;
            if (type == GGML_TYPE_Q8_0) {
                const ssr_block_q8_0x8 * w = (const ssr_block_q8_0x8 *)src0->data + g * nb;
                SSR_X86_CASE_T4(ssr_x86_q8_0x8(TT, (int)nb, w, y, row_size, out, out_stride));
            } else if (type == GGML_TYPE_Q4_K) {
                const ssr_block_q4_Kx8 * w = (const ssr_block_q4_Kx8 *)src0->data + g * nb;
                SSR_X86_CASE_T4(ssr_x86_q4_Kx8(TT, (int)nb, w, y, row_size, out, out_stride));
            } else {  // GGML_TYPE_Q6_K
                const ssr_block_q6_Kx8 * w = (const ssr_block_q6_Kx8 *)src0->data + g * nb;
                SSR_X86_CASE_T4(ssr_x86_q6_Kx8(TT, (int)nb, w, y, row_size, out, out_stride));
            }
        }
    }
}

#define SSR_X86_ROWS 1
#endif
