// SSR's attention for exact mode (added to the vendored llama.cpp by scripts/install_llama_cpp.sh, included by
// ggml-cpu/ops.cpp just before ggml_compute_forward_flash_attn_ext_f16, which calls ssr_flash_attn_ext first when
// the CPU backend's use_ref is on: GGML_CPU_USE_REF=1 when the context is created, as exact mode does).
//
// Why: exact mode needs every query row's output to have the same bits whatever else is in the batch and wherever
// its keys lie in the cache (draft lanes' cells sit between a lane's own). ggml's reference path gives that (each
// row over its keys one by one in cell order) but slowly: an f16 accumulator converted at every key and one scalar
// exp a key, 1.21x the tiled kernel's prefill at 300 tokens and 1.56x at 1000 on the Xeon VM of
// docs/backends/llama-cpp.md. ggml's tiled kernel is fast but rescales its running sums at fixed 64-cell tiles of
// the cache, so a row's bits depend on where its keys lie. Here a block of up to SSR_ATTN_ROWS query rows gathers the
// cells any of them attends (in cell order) and converts those keys and values once for every query head that reads
// them; each score is one float FMA chain over the head dimension; each row takes its maximum, its exponentials
// through one vector routine, then its sum and its weighted sum of values in cell order, skipping the keys it does
// not attend: every operation a row's output goes through,
// and their order, depend only on that row's query and its own keys in cell order, never on the other rows of the
// block, of the batch, or on cells it does not attend. Other bits than the reference path's (f32 query and
// accumulators), the same in every batch.
//
// Handles what the engine's models use (f32 queries, f16 keys and values, an f16 mask or none, no ALiBi, no logit
// softcap, no attention sinks); ssr_flash_attn_ext returns false for anything else and ggml's path runs.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifndef SSR_ATTN_ROWS
#define SSR_ATTN_ROWS 32  // query rows of one head per block (they share the gathered keys and their conversion)
#endif
#define SSR_ATTN_KEYS 128  // keys per chunk: the score loop's vector accumulators (8 zmm, 16 ymm)

// y[i] = exp(x[i] - m) for i < n, n a multiple of 16, every element through the same vector routine (ggml's
// ggml_v_expf where the build has one, libm's expf otherwise), so a value's exponential does not depend on its
// position in the buffer.
static inline void ssr_attn_exp(float * y, const float * x, float m, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    for (int64_t i = 0; i < n; i += 16) {
        _mm512_storeu_ps(y + i, ggml_v_expf(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(m))));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (int64_t i = 0; i < n; i += 8) {
        _mm256_storeu_ps(y + i, ggml_v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(m))));
    }
#else
    for (int64_t i = 0; i < n; ++i) {
        y[i] = expf(x[i] - m);
    }
#endif
}

// The largest of x[0..n), n a multiple of 16. A maximum is the same whatever order it is taken in (the scores are
// finite or -inf; the sign of a zero maximum does not change exp(x - m)), so a vector reduction gives every row the
// value the one-by-one loop gave. That loop called libm's fmaxf once a key (GCC does not inline it without
// -ffinite-math-only): 1.4 million calls a row a step at 4096 cached tokens on the 0.5B.
static inline float ssr_attn_max(const float * x, int64_t n) {
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    }
    return _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 8) {
        m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float r = lanes[0];
    for (int k = 1; k < 8; ++k) {
        r = lanes[k] > r ? lanes[k] : r;
    }
    return r;
#else
    float r = -INFINITY;
    for (int64_t i = 0; i < n; ++i) {
        r = x[i] > r ? x[i] : r;
    }
    return r;
#endif
}

struct ssr_attn_scratch {
    std::vector<int64_t> cells;    // the block's gathered key cells, in cell order
    std::vector<uint8_t> attended; // [n_kv]: whether any row of the block attends the cell
    std::vector<float>   mask;     // [rows][n_pad]: each row's mask value at each gathered cell
    std::vector<float>   kt;       // [n_pad / KEYS][DK][KEYS]: the gathered keys in f32, transposed chunk by chunk
    std::vector<float>   v;        // [n][DV]: the gathered values in f32
    std::vector<float>   q;        // [rows][DK]
    std::vector<float>   scores;   // [rows][n_pad]: scores, then exponentials
    std::vector<float>   out;      // [rows][DV]
    std::vector<float>   sums;     // [rows]: each row's sum of exponentials
    std::vector<float>   key;      // [DK]: one key in f32
};

// out[r] = sum over j in order of p[r][j] * v[j], the p that are zero skipped: two rows at a time, each row's DV
// accumulators held in registers (DV a compile-time constant), each row's operations those of the row alone.
template <int DV> static void ssr_attn_values(ssr_attn_scratch & s, int64_t nr, int64_t n, int64_t n_pad) {
    int64_t r = 0;
    for (; r + 1 < nr; r += 2) {
        const float * p0 = s.scores.data() + r*n_pad;
        const float * p1 = p0 + n_pad;
        float a0[DV] = {}, a1[DV] = {};
        for (int64_t j = 0; j < n; ++j) {
            const float * vj = s.v.data() + j*DV;
            if (p0[j] != 0.0f) {
                for (int d = 0; d < DV; ++d) {
                    a0[d] = fmaf(p0[j], vj[d], a0[d]);
                }
            }
            if (p1[j] != 0.0f) {
                for (int d = 0; d < DV; ++d) {
                    a1[d] = fmaf(p1[j], vj[d], a1[d]);
                }
            }
        }
        memcpy(s.out.data() + r*DV, a0, sizeof(a0));
        memcpy(s.out.data() + (r + 1)*DV, a1, sizeof(a1));
    }
    for (; r < nr; ++r) {
        const float * p0 = s.scores.data() + r*n_pad;
        float a0[DV] = {};
        for (int64_t j = 0; j < n; ++j) {
            const float * vj = s.v.data() + j*DV;
            if (p0[j] != 0.0f) {
                for (int d = 0; d < DV; ++d) {
                    a0[d] = fmaf(p0[j], vj[d], a0[d]);
                }
            }
        }
        memcpy(s.out.data() + r*DV, a0, sizeof(a0));
    }
}

static void ssr_attn_values_any(ssr_attn_scratch & s, int64_t nr, int64_t n, int64_t n_pad, int64_t DV) {
    for (int64_t r = 0; r < nr; ++r) {
        const float * p0 = s.scores.data() + r*n_pad;
        float * o = s.out.data() + r*DV;
        memset(o, 0, DV*sizeof(float));
        for (int64_t j = 0; j < n; ++j) {
            if (p0[j] != 0.0f) {
                const float * vj = s.v.data() + j*DV;
                for (int64_t d = 0; d < DV; ++d) {
                    o[d] = fmaf(p0[j], vj[d], o[d]);
                }
            }
        }
    }
}

// Rows iq1 in [r0, r0 + nr) of every query head that reads key/value head ik2: the keys and values any of those rows
// attends are gathered and converted once for all of them (grouped-query attention shares them).
static void ssr_attn_group(const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v,
                           const ggml_tensor * mask, ggml_tensor * dst, float scale,
                           int64_t ik2, int64_t r0, int64_t nr, ssr_attn_scratch & s) {
    const int64_t DK = k->ne[0], DV = v->ne[0], n_kv = k->ne[1], group = q->ne[2] / k->ne[2];
    auto mask_row = [&](int64_t r) { return (const ggml_fp16_t *)((const char *) mask->data + (r0 + r)*mask->nb[1]); };

    // the cells any row attends, in cell order, and each row's mask value there. -INFINITY is the one f16 value
    // that hides a cell (0xFC00): comparing the bits row by row vectorizes, so cells no row attends (other lanes',
    // kept cells of exact mode) cost a few instructions per 32 rows
    s.attended.assign(n_kv, mask ? 0 : 1);
    for (int64_t r = 0; mask && r < nr; ++r) {
        const uint16_t * bits = (const uint16_t *) mask_row(r);
        uint8_t * any = s.attended.data();
        for (int64_t ic = 0; ic < n_kv; ++ic) {
            any[ic] |= bits[ic] != 0xFC00;
        }
    }
    s.cells.clear();
    for (int64_t ic = 0; ic < n_kv; ++ic) {
        if (s.attended[ic]) {
            s.cells.push_back(ic);
        }
    }
    const int64_t n = (int64_t) s.cells.size();
    const int64_t n_pad = (n + SSR_ATTN_KEYS - 1) / SSR_ATTN_KEYS * SSR_ATTN_KEYS;
    s.mask.assign(nr * n_pad, -INFINITY);
    for (int64_t r = 0; r < nr; ++r) {
        for (int64_t j = 0; j < n; ++j) {
            s.mask[r*n_pad + j] = mask ? GGML_CPU_FP16_TO_FP32(mask_row(r)[s.cells[j]]) : 0.0f;
        }
    }
    s.kt.assign(DK * n_pad, 0.0f);
    s.v.resize(n * DV);
    s.key.resize(DK);
    for (int64_t j = 0; j < n; ++j) {
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)((const char *) k->data + s.cells[j]*k->nb[1] + ik2*k->nb[2]),
                              s.key.data(), DK);
        float * chunk = s.kt.data() + (j / SSR_ATTN_KEYS)*DK*SSR_ATTN_KEYS + j % SSR_ATTN_KEYS;
        for (int64_t d = 0; d < DK; ++d) {
            chunk[d*SSR_ATTN_KEYS] = s.key[d];
        }
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)((const char *) v->data + s.cells[j]*v->nb[1] + ik2*v->nb[2]),
                              s.v.data() + j*DV, DV);
    }
    s.q.resize(nr * DK);
    s.out.resize(nr * DV);
    s.sums.resize(nr);
    const int64_t ne1 = dst->ne[1];

    for (int64_t iq2 = ik2*group; iq2 < (ik2 + 1)*group; ++iq2) {
        for (int64_t r = 0; r < nr; ++r) {
            memcpy(s.q.data() + r*DK, (const char *) q->data + (r0 + r)*q->nb[1] + iq2*q->nb[2], DK*sizeof(float));
        }
        // scores: each one FMA chain over the head dimension, d = 0 .. DK-1, then fma(dot, scale, mask value)
        s.scores.assign(nr * n_pad, -INFINITY);
        for (int64_t c0 = 0; c0 < n; c0 += SSR_ATTN_KEYS) {
            const int64_t cn = std::min<int64_t>(SSR_ATTN_KEYS, n - c0);
            for (int64_t r = 0; r < nr; ++r) {
                const float * qr = s.q.data() + r*DK;
                float acc[SSR_ATTN_KEYS] = {};
                for (int64_t d = 0; d < DK; ++d) {
                    const float qd = qr[d];
                    const float * kd = s.kt.data() + c0*DK + d*SSR_ATTN_KEYS;
                    for (int j = 0; j < SSR_ATTN_KEYS; ++j) {
                        acc[j] = fmaf(qd, kd[j], acc[j]);
                    }
                }
                float * sr = s.scores.data() + r*n_pad + c0;
                const float * mr = s.mask.data() + r*n_pad + c0;
                for (int64_t j = 0; j < cn; ++j) {
                    sr[j] = mr[j] == -INFINITY ? -INFINITY : fmaf(acc[j], scale, mr[j]);
                }
            }
        }
        // each row: its maximum, its weights (exponentials; zero for keys it does not attend), their sum in cell
        // order, then its weighted sum of values in cell order (weights that are zero skipped)
        for (int64_t r = 0; r < nr; ++r) {
            float * sr = s.scores.data() + r*n_pad;
            const float * mr = s.mask.data() + r*n_pad;
            const float m = ssr_attn_max(sr, n_pad);  // the padding past n holds -inf
            float sum = 0.0f;
            if (m != -INFINITY) {
                ssr_attn_exp(sr, sr, m, n_pad);
                for (int64_t j = 0; j < n; ++j) {
                    if (mr[j] == -INFINITY) {
                        sr[j] = 0.0f;  // whatever the vector exp made of -inf
                    } else if (sr[j] != 0.0f) {
                        sum += sr[j];
                    }
                }
            } else {
                memset(sr, 0, n*sizeof(float));
            }
            s.sums[r] = sum;
        }
        if (DV == 64) {
            ssr_attn_values<64>(s, nr, n, n_pad);
        } else if (DV == 128) {
            ssr_attn_values<128>(s, nr, n, n_pad);
        } else {
            ssr_attn_values_any(s, nr, n, n_pad, DV);
        }
        for (int64_t r = 0; r < nr; ++r) {
            float * o = s.out.data() + r*DV;
            const float inv = s.sums[r] == 0.0f ? 0.0f : 1.0f/s.sums[r];
            for (int64_t d = 0; d < DV; ++d) {
                o[d] *= inv;
            }
            // dst is permuted (0, 2, 1, 3), as ggml's kernels write it
            memcpy((char *) dst->data + (iq2 + (r0 + r)*ne1)*dst->nb[1], o, dst->nb[1]);
        }
    }
}

// The whole op on this thread's share of (block of rows, key/value head); false where this kernel does not apply.
static bool ssr_flash_attn_ext(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];
    float scale = 1.0f, max_bias = 0.0f, softcap = 0.0f;
    memcpy(&scale, (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (!params->use_ref || q->type != GGML_TYPE_F32 || k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16
        || (mask && (mask->type != GGML_TYPE_F16 || mask->ne[2] != 1 || mask->ne[3] != 1)) || sinks
        || max_bias != 0.0f || softcap != 0.0f || q->ne[3] != 1 || k->ne[3] != 1 || v->ne[3] != 1
        || k->ne[2] != v->ne[2] || q->ne[2] % k->ne[2] != 0 || dst->nb[0] != sizeof(float)
        || q->nb[0] != sizeof(float) || k->nb[0] != sizeof(ggml_fp16_t) || v->nb[0] != sizeof(ggml_fp16_t)) {
        return false;
    }
    thread_local ssr_attn_scratch scratch;
    const int64_t n_rows = q->ne[1], blocks = (n_rows + SSR_ATTN_ROWS - 1) / SSR_ATTN_ROWS;
    for (int64_t item = params->ith; item < blocks * k->ne[2]; item += params->nth) {
        const int64_t r0 = (item / k->ne[2]) * SSR_ATTN_ROWS;
        ssr_attn_group(q, k, v, mask, dst, scale, item % k->ne[2], r0, std::min<int64_t>(SSR_ATTN_ROWS, n_rows - r0),
                       scratch);
    }
    return true;
}
