// SSR's quantization of activations to Q8_K for ggml's AMX matmul (added to the vendored llama.cpp by
// scripts/install_llama_cpp.sh, included by ggml-cpu/amx/mmq.cpp before from_float, which calls it for Q8_K).
//
// Why: ggml's AMX path quantizes every row of a K-quant matmul's input with quantize_row_q8_K_ref (its own comment:
// "this is reference impl"), whose search for the largest magnitude runs one value at a time. On the Xeon VM of
// docs/backends/llama-cpp.md that was 6-7% of a 600-token prefill of Qwen2.5-Coder-1.5B and a share of every
// verified row. This is the same function with AVX-512, bit for bit: the same largest magnitude and the first value
// that has it, the same scale (-127 / that value), each product rounded and then the same float addition that
// rounds it to an integer (the _round_ intrinsics, which the compiler does not fuse into one multiply-add), the
// same clamp, group sums and inverse scale.

#pragma once  // (included inside mmq.cpp's anonymous namespace: no standard headers here)

inline void ssr_quantize_row_q8_K(const float * RESTRICT x, block_q8_K * RESTRICT y, int64_t k) {
    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const int64_t nb = k / QK_K;
    const __m512 magic = _mm512_set1_ps(12582912.f);  // nearest_int's 1.5 * 2^23
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        __m512 vmax = _mm512_setzero_ps();
        for (int j = 0; j < QK_K; j += 16) {
            vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), vmax);  // a NaN is passed over, as there
        }
        const float amax = _mm512_reduce_max_ps(vmax);
        if (!amax) {
            y[i].d = 0;
            __builtin_memset(y[i].qs, 0, QK_K);
            continue;
        }
        float max = 0;
        for (int j = 0; j < QK_K; j += 16) {  // the first value of that magnitude
            const __mmask16 at = _mm512_cmpeq_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), _mm512_set1_ps(amax));
            if (at) {
                max = x[j + __builtin_ctz(at)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m512 vscale = _mm512_set1_ps(iscale);
        for (int g = 0; g < QK_K / 16; ++g) {
            const __m512 product = _mm512_mul_round_ps(vscale, _mm512_loadu_ps(x + g * 16), R);
            const __m512i bits = _mm512_castps_si512(_mm512_add_round_ps(product, magic, R));
            __m512i v = _mm512_sub_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)), _mm512_set1_epi32(0x00400000));
            v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(y[i].qs + g * 16), _mm512_cvtepi32_epi8(v));
            y[i].bsums[g] = (int16_t)_mm512_reduce_add_epi32(v);
        }
        y[i].d = 1 / iscale;
    }
}
