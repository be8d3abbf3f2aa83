// SSR's eight-row layouts for Q8_0, Q4_K and Q6_K weights in ggml's CPU repack buffer (included by
// ggml-cpu/repack.cpp, patch 0008): the weights exact mode loads are repacked into groups of eight rows
// (ssr_rows_x86.h: ssr_block_q8_0x8, ssr_block_q4_Kx8, ssr_block_q6_Kx8) and every matmul of them runs that
// header's kernels, a single token included.
//
// Why here: the repack buffer is how ggml gives a weight type a layout of its own (the layout chosen per tensor as it
// loads, its matmuls sent to the layout's kernels). Exact mode (GGML_CPU_USE_REF, which SSR sets while it loads the
// model, as while it creates the context) takes it for SSR's layouts alone: ggml's own repacked kernels (Q4_0, Q4_K,
// IQ4_NL, ... on AVX2) round a row differently with the batch, so in exact mode every other weight stays on ggml's
// layout, where patch 0007 computes each row alike. Outside exact mode nothing changes. A tensor keeps the layout
// it was loaded with, whatever the environment later. SSR_X86_LAYOUT=0 (environment) loads ggml's layout instead.

#pragma once

#include "ssr_rows_x86.h"

#ifdef SSR_X86_ROWS

#include <cstdlib>

namespace ssr_x86 {

// ggml's tensor_traits for a Q8_0, Q4_K or Q6_K matrix in SSR's layout: its matmuls, and its repacking as it
// loads.
class rows8 : public ggml::cpu::repack::tensor_traits_base {
    bool work_size(int /* n_threads */, const struct ggml_tensor * op, size_t & size) override {
        if (op->op != GGML_OP_MUL_MAT) {
            return false;
        }
        const ggml_type vec_dot_type = ggml_get_type_traits_cpu(op->src[0]->type)->vec_dot_type;
        size = ggml_row_size(vec_dot_type, op->src[1]->ne[0]) * ggml_nrows(op->src[1]);
        return true;
    }

    // The tokens quantized (to Q8_0 or Q8_K; thread i takes rows i, i + nth, ...), then each thread's share of the
    // groups.
    bool compute_forward(struct ggml_compute_params * params, struct ggml_tensor * op) override {
        if (op->op != GGML_OP_MUL_MAT) {
            return false;
        }
        const ggml_tensor * src1 = op->src[1];
        GGML_ASSERT(src1->type == GGML_TYPE_F32 && op->type == GGML_TYPE_F32 && ggml_is_contiguous(op));
        const ggml_type vec_dot_type = ggml_get_type_traits_cpu(op->src[0]->type)->vec_dot_type;
        const int64_t k = src1->ne[0], n_y = ggml_nrows(src1);
        const size_t row_size = ggml_row_size(vec_dot_type, k);
        char * wdata = static_cast<char *>(params->wdata);
        const ggml_from_float_t quantize = ggml_get_type_traits_cpu(vec_dot_type)->from_float;
        for (int64_t i = params->ith; i < n_y; i += params->nth) {
            const int64_t i11 = i % src1->ne[1], i12 = i / src1->ne[1] % src1->ne[2];
            const int64_t i13 = i / (src1->ne[1] * src1->ne[2]);
            const char * row = (const char *) src1->data + i11 * src1->nb[1] + i12 * src1->nb[2] + i13 * src1->nb[3];
            quantize(reinterpret_cast<const float *>(row), wdata + i * row_size, k);
        }
        ggml_barrier(params->threadpool);
        ssr_x86_layout_mul_mat(params, op->src[0], op, wdata, row_size);
        return true;
    }

    int repack(struct ggml_tensor * t, const void * data, size_t data_size) override {
        GGML_ASSERT(t->ne[1] % 8 == 0 && data_size == ggml_nbytes(t));
        if (t->type == GGML_TYPE_Q8_0) {
            ssr_x86_repack_q8_0(ggml_nrows(t), t->ne[0], static_cast<const block_q8_0 *>(data),
                                static_cast<ssr_block_q8_0x8 *>(t->data));
        } else if (t->type == GGML_TYPE_Q4_K) {
            ssr_x86_repack_q4_K(ggml_nrows(t), t->ne[0], static_cast<const block_q4_K *>(data),
                                static_cast<ssr_block_q4_Kx8 *>(t->data));
        } else {
            GGML_ASSERT(t->type == GGML_TYPE_Q6_K);
            ssr_x86_repack_q6_K(ggml_nrows(t), t->ne[0], static_cast<const block_q6_K *>(data),
                                static_cast<ssr_block_q6_Kx8 *>(t->data));
        }
        return 0;
    }
};

}  // namespace ssr_x86

// Whether exact mode is loading (GGML_CPU_USE_REF set) with SSR's layout on (SSR_X86_LAYOUT unset or not 0).
inline bool ssr_x86_layout_loading() {
    const char * off = getenv("SSR_X86_LAYOUT");
    return getenv("GGML_CPU_USE_REF") != nullptr && ssr_x86_rows_on() && (off == nullptr || atoi(off) != 0);
}

// The layout ggml's repack buffer gives cur: the one it was loaded with; while exact mode loads, SSR's for Q8_0, Q4_K
// and Q6_K matrices of whole groups and ggml's layout (nullptr) for every other; else ggml's own choice (false: not
// decided here).
inline bool ssr_x86_layout_choice(const struct ggml_tensor * cur, const ggml::cpu::tensor_traits *& choice) {
    static const ssr_x86::rows8 rows8;
    if (cur->extra != nullptr && cur->buffer != nullptr && cur->buffer->buft == ggml_backend_cpu_repack_buffer_type()) {
        choice = static_cast<const ggml::cpu::tensor_traits *>(cur->extra);
        return true;
    }
    if (!ssr_x86_layout_loading()) {
        return false;
    }
    const bool ours = (cur->type == GGML_TYPE_Q8_0 || cur->type == GGML_TYPE_Q4_K || cur->type == GGML_TYPE_Q6_K) &&
                      ggml_n_dims(cur) == 2 && cur->ne[1] % 8 == 0;
    choice = ours ? &rows8 : nullptr;
    return true;
}

// The bytes ggml's repack buffer allocates for cur: SSR's Q4_K layout takes 1184 bytes a group's block against
// ggml's 1152 (its scales decoded); every other layout, ggml's size.
inline size_t ssr_x86_layout_alloc_size(ggml_backend_buffer_type_t /* buft */, const struct ggml_tensor * cur) {
    const ggml::cpu::tensor_traits * choice = nullptr;
    if (cur->type == GGML_TYPE_Q4_K && ssr_x86_layout_choice(cur, choice) &&
        dynamic_cast<const ssr_x86::rows8 *>(choice) != nullptr) {
        return (size_t) (ggml_nrows(cur) / 8) * (size_t) (cur->ne[0] / QK_K) * sizeof(ssr_block_q4_Kx8);
    }
    return ggml_nbytes(cur);
}

#endif
