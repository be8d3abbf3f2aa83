"""The machine's roofline, measured: memory read bandwidth and int8 multiply-add peak, at the thread count the
benchmarks run (``python -m ssr_bench.roofline --threads 2``).

Why: a step's time means little alone; set against what the memory and the int8 units can do, it shows how far a
kernel sits from the limit (a one-row step reads every weight once: bound by bandwidth; each further row adds only
arithmetic). The numbers come from a small C program compiled here with g++ and OpenMP, for the best int8 dot
product the CPU has: AVX-512 VNNI (vpdpbusd, 64 multiply-adds an instruction), AVX-VNNI (32), else AVX2's
vpmaddubsw + vpmaddwd (32 a pair).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from ssr.calibrate import _cpuinfo

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// bytes read a second: every thread sums its share of a buffer far larger than the caches, best of 5 passes
static double bandwidth(size_t bytes) {
    char * buf = (char *)aligned_alloc(64, bytes);
    #pragma omp parallel for
    for (size_t i = 0; i < bytes; i += 4096) memset(buf + i, (int)i, 4096);
    double best = 1e30; long long sink = 0;
    for (int rep = 0; rep < 5; ++rep) {
        double t0 = now();
        #pragma omp parallel reduction(+:sink)
        {
            __m256i acc = _mm256_setzero_si256();
            #pragma omp for
            for (size_t i = 0; i < bytes; i += 128) {
                acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(buf + i)));
                acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(buf + i + 32)));
                acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(buf + i + 64)));
                acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(buf + i + 96)));
            }
            sink += _mm256_extract_epi64(acc, 0);
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    free(buf);
    if (sink == 42) puts("");
    return bytes / best;
}

// int8 multiply-adds a second: 12 independent accumulator chains a thread
static double int8_peak(long iters) {
    double best = 1e30; long long sink = 0;
    for (int rep = 0; rep < 3; ++rep) {
        double t0 = now();
        #pragma omp parallel reduction(+:sink)
        {
#if defined(__AVX512VNNI__)
            __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), c[12];
            for (int j = 0; j < 12; ++j) c[j] = _mm512_setzero_si512();
            for (long i = 0; i < iters; ++i)
                for (int j = 0; j < 12; ++j) c[j] = _mm512_dpbusd_epi32(c[j], a, b);
            for (int j = 1; j < 12; ++j) c[0] = _mm512_add_epi32(c[0], c[j]);
            sink += _mm512_reduce_add_epi32(c[0]);
#elif defined(__AVXVNNI__)
            __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), c[12];
            for (int j = 0; j < 12; ++j) c[j] = _mm256_setzero_si256();
            for (long i = 0; i < iters; ++i)
                for (int j = 0; j < 12; ++j) c[j] = _mm256_dpbusd_avx_epi32(c[j], a, b);
            for (int j = 1; j < 12; ++j) c[0] = _mm256_add_epi32(c[0], c[j]);
            sink += _mm256_extract_epi32(c[0], 0);
#else
            __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1), c[12];
            for (int j = 0; j < 12; ++j) c[j] = _mm256_setzero_si256();
            for (long i = 0; i < iters; ++i)
                for (int j = 0; j < 12; ++j)
                    c[j] = _mm256_add_epi32(c[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), one));
            for (int j = 1; j < 12; ++j) c[0] = _mm256_add_epi32(c[0], c[j]);
            sink += _mm256_extract_epi32(c[0], 0);
#endif
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    if (sink == 42) puts("");
#if defined(__AVX512VNNI__)
    const double per = 64;
#else
    const double per = 32;
#endif
    return omp_get_max_threads() * (double)iters * 12 * per / best;
}

int main() {
    printf("{\"threads\": %d, \"read_gb_s\": %.2f, \"int8_gmac_s\": %.1f}\n", omp_get_max_threads(),
           bandwidth((size_t)1 << 30) / 1e9, int8_peak(20000000) / 1e9);
}
"""


# The int8 dot products the program can be built for: name, g++ flags, the /proc/cpuinfo flags a CPU needs.
ISAS = {
    "avx512-vnni": ("AVX-512 VNNI", ["-mavx512f", "-mavx512bw", "-mavx512vnni"],
                    {"avx512f", "avx512bw", "avx512_vnni"}),
    "avx-vnni": ("AVX-VNNI", ["-mavx2", "-mavxvnni"], {"avx2", "avx_vnni"}),
    "avx2": ("AVX2", ["-mavx2"], {"avx2"}),
}


def _isa(name: str | None = None) -> tuple[str, list[str]]:
    """The int8 dot product ``name`` (a key of ISAS; it must run here), else the best this CPU has, and the compiler
    flags for it. Naming one measures a class below the CPU's own: AVX2's peak on an AVX-512 machine, for one."""
    flags = set((_cpuinfo().get("flags") or "").split())
    if name is not None:
        label, gcc_flags, needs = ISAS[name]
        if not needs <= flags:
            raise SystemExit(f"roofline: this CPU lacks {', '.join(sorted(needs - flags))} for {label}")
        return label, gcc_flags
    for label, gcc_flags, needs in ISAS.values():
        if needs <= flags:
            return label, gcc_flags
    raise SystemExit("roofline: needs AVX2")


def measure(threads: int, isa_name: str | None = None) -> dict:
    if shutil.which("g++") is None:
        raise SystemExit("roofline: needs g++")
    isa, flags = _isa(isa_name)
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "roofline.cpp", Path(tmp) / "roofline"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-funroll-loops", "-fopenmp", *flags, str(src), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                             env={"OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "spread", "PATH": "/usr/bin"})
    return {"int8_instructions": isa, **json.loads(out.stdout)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ssr_bench.roofline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=sorted(ISAS), help="the int8 dot product to measure (default: the best here)")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.threads, args.isa)))


if __name__ == "__main__":
    main()
