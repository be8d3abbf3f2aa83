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
// SSR_X86_ROWS=0 (environment, read once) turns them off: exact mode then runs ggml's vec_dot for every row.

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

// Per 32-bit lane the sum of four products of unsigned ax and signed sy bytes (lane k: bytes 4k..4k+3).
static inline __m256i ssr_x86_dot_us8(__m256i ax, __m256i sy) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, sy);
#else
    return _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(ax, sy));
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
            const __m256 q = _mm256_cvtepi32_ps(ssr_x86_dot_us8(ax, _mm256_sign_epi8(qy, qx)));
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
        const float xd = GGML_CPU_FP16_TO_FP32(x->d), xdmin = GGML_CPU_FP16_TO_FP32(x->dmin);

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

#define SSR_X86_ROWS 1
#endif
