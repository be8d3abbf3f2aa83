// What ggml's AMX backend may use in this process: AMX tiles, or SSR's rows kernels alone (patch 0006, included by
// ggml-cpu/amx/amx.cpp and by ssr_amx_rows.h).
//
// Why: SSR's rows kernels (ssr_amx_rows.h) need AVX-512 VNNI, not AMX. On a CPU with AVX-512 VNNI and no AMX (AMD
// Zen 4 and Zen 5, Intel Xeons from Cascade Lake to Ice Lake) the AMX buffer type still repacks the weights of the
// types those kernels cover into its layout at load, and every matmul of them runs those kernels: each row with
// the same bits in any batch, a single row included. No tile instruction runs there; ggml's own kernels take every
// other weight type.

#pragma once

#include <climits>
#include <cstdlib>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The tiles' register state granted to this process (Linux asks for it with arch_prctl; a CPU without AMX refuses).
inline bool ssr_amx_tiles() {
    static const bool granted = [] {
#if defined(__linux__)
        return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
        return false;
#endif
    }();
    return granted;
}

// SSR_AMX_VNNI_ROWS (environment, read once): with AMX, batches of more than this many rows go to ggml's AMX tiles;
// without AMX, 0 turns SSR's kernels off (ggml's own kernels then run every matmul: the baseline to measure against)
// and any other value changes nothing. Unset: every batch takes SSR's kernels.
inline int ssr_rows_env() {
    static const int rows = [] {
        const char * env = getenv("SSR_AMX_VNNI_ROWS");
        return env ? atoi(env) : INT_MAX;
    }();
    return rows;
}

// The weight types SSR's rows kernels cover, and the output widths they take (work items of 4 tiles of 16 columns).
inline bool ssr_rows_type(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q8_0;
}

constexpr int SSR_ROWS_COLUMNS = 64;

// Whether the AMX buffer type takes a matmul of these weights: with tiles every type ggml's AMX backend covers;
// without them only those SSR's kernels cover, and only while they are on.
inline bool ssr_amx_takes(enum ggml_type type, long long n_columns) {
    return ssr_amx_tiles() || (ssr_rows_env() != 0 && ssr_rows_type(type) && n_columns % SSR_ROWS_COLUMNS == 0);
}
