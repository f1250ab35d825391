"""A float32 GEMM whose bits do not depend on the machine: every output summed in one fixed order.

``fixed_order_mm(a, b)`` computes ``c[m, n] = Σ_k a[m, k] · b[k, n]`` as the chain

    acc = +0;  for k = 0 … K−1:  acc = fma(a[m, k], b[k, n], acc)

in float32, for every output on its own. Each step is one IEEE 754 fused multiply-add, correctly
rounded by definition, so the chain has exactly one result; what a machine may vary cannot touch it:

- the SIMD width (SSE, AVX2, AVX-512) only decides how many *independent outputs* (adjacent ``n``)
  advance together: the reduction over ``k`` is never split, reordered or vectorised;
- threads own whole tiles of outputs, never a part of a sum, so the thread count cannot matter; where
  ``a``'s columns are not adjacent and the sum is long (a weight gradient's ``g.t()``, summed over the
  tokens), the chain runs in blocks of 256 steps over packed copies of both operands, each block continuing
  from the value the previous one stored (a float stored and loaded is the same float), the blocks in k order
  with a barrier between them: the same chain, with both operands kept in cache;
- a row's result depends on that row of ``a`` and on ``b`` alone, never on other rows or on the
  batch's shape: a tile of up to 12 rows (AVX-512 intrinsics, where ATen reports AVX-512), a tile of
  6 rows (AVX2 intrinsics where the compiler targets AVX2 and FMA3) and a tile with fewer rows
  (plain C, the rows it has) compute the same chain per output, and a tile
  past the last column computes its missing columns from whatever lies there (zeros, or the
  neighbouring memory of a view) in SIMD lanes of their own, then drops them;
- ``b`` is read in place when its rows are row-major and readable to the next multiple of 16
  columns, and otherwise copied panel by panel into a zero-padded buffer first (a transposed
  ``b``): a copy changes no value, so the two ways give the same bits;
- the C code is compiled with ``-ffp-contract=off`` and without fast-math, so the compiler adds no
  contraction or reassociation of its own; the only fma is the one written, which is an fma on
  every target (FMA3 instructions where the CPU has them, the C library's correctly rounded
  ``fmaf`` otherwise).

This is what batch-invariant GPU kernels do (a reduction order fixed per output, independent of
the batch); on a CPU it also makes the result independent of the kernel set. Its speed is about MKL's
float32 GEMM's at the shapes of the built-in model, with weights kept in rows padded to an odd
number of cache lines (``gemm_layout``), and about twice a float64 GEMM's, which it replaces
(``bench/rollout.py``, ``gemm_gflops_1024x512x512``; docs/alignment.md, "Cost").

The kernel is a small C file compiled on first use with the system's C compiler into a per-user
cache and called through ``ctypes``; its threads are OpenMP's (``libgomp.so.1``, the runtime torch's
CPU wheels already load).
Where it cannot build (no compiler), ``fixed_order_mm_reference`` computes the same chain with
PyTorch operations (float64 with round-to-odd, then one rounding to float32: exactly the fma's
result; Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms
using rounding to odd", IEEE Trans. Computers 2008): the same bits, much slower, said once in a
warning. ``DRIFTLESS_FIXED_MM=reference`` selects it on purpose (tests compare the two).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings

import torch

ENV = "DRIFTLESS_FIXED_MM"  # "native" (default: the compiled kernel, else the reference) or "reference"

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MR 6
#define NR 16
#define MB 60

#if defined(__AVX512F__)
#define MT 12 /* rows a tile: tile_z below */
#else
#define MT MR
#endif

/* One tile: rows 0 .. mr-1 of a (row stride lda) against columns 0 .. NR-1 of b (row stride ldb),
   each output one fma chain over k; the first nr columns are stored. b's rows must be readable up
   to column NR (the caller pads): the columns past nr are computed and dropped, so every tile runs
   the same vector code. mr is a constant in each inlined copy (the accumulators stay in registers). */
static inline __attribute__((always_inline)) void tile(const float *a, int64_t lda, const float *b, int64_t ldb,
                                                       float *c, int64_t ldc, int64_t K, const int mr, int64_t nr) {
    float acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
        const float *bk = b + k * ldb;
        _Pragma("GCC unroll 6")
        for (int i = 0; i < mr; ++i) {
            const float ai = a[i * lda + k];
            _Pragma("GCC unroll 16")
            for (int j = 0; j < NR; ++j) acc[i][j] = __builtin_fmaf(ai, bk[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = acc[i][j];
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* tile() for a full MR = 6 rows, written with AVX2 / FMA3 intrinsics so that the 12 accumulators (6 rows x 2
   vectors of 8 columns) stay in registers (GCC's code for the array above spills at 6 rows). _mm256_fmadd_ps is 8
   independent correctly rounded fmas, one per column: every output is the same chain, in the same k order, from the
   same +0, as in tile(), so the bits are tile()'s. */
/* the 12 accumulators c00 .. c51 of a 6 x 16 tile into rows of c (row stride ldc), the first nr columns */
#define STORE6(c, ldc, nr) do { \
        float out[MR][NR]; \
        _mm256_storeu_ps(out[0], c00); _mm256_storeu_ps(out[0] + 8, c01); \
        _mm256_storeu_ps(out[1], c10); _mm256_storeu_ps(out[1] + 8, c11); \
        _mm256_storeu_ps(out[2], c20); _mm256_storeu_ps(out[2] + 8, c21); \
        _mm256_storeu_ps(out[3], c30); _mm256_storeu_ps(out[3] + 8, c31); \
        _mm256_storeu_ps(out[4], c40); _mm256_storeu_ps(out[4] + 8, c41); \
        _mm256_storeu_ps(out[5], c50); _mm256_storeu_ps(out[5] + 8, c51); \
        for (int i = 0; i < MR; ++i) \
            for (int64_t j = 0; j < (nr); ++j) (c)[i * (ldc) + j] = out[i][j]; \
    } while (0)
#define ROW(i) ai = _mm256_broadcast_ss(a + (i) * lda + k); \
               c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0); c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);
static inline __attribute__((always_inline)) void tile6(const float *a, int64_t lda, const float *b, int64_t ldb,
                                                        float *c, int64_t ldc, int64_t K, int64_t nr) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, ai;
    for (int64_t k = 0; k < K; ++k) {
        const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    STORE6(c, ldc, nr);
}
#undef ROW
#define FULL_TILE(a, lda, b, ldb, c, ldc, K, nr) tile6(a, lda, b, ldb, c, ldc, K, nr)
#else
#define FULL_TILE(a, lda, b, ldb, c, ldc, K, nr) tile(a, lda, b, ldb, c, ldc, K, MR, nr)
#endif

#if defined(__AVX512F__)
/* tile() with AVX-512 (built where ATen reports AVX-512): one 16-lane vector of accumulators per row, up to MT = 12
   rows (12 of the 32 vector registers). _mm512_fmadd_ps is 16 independent correctly rounded fmas, one per column,
   so every output is again the chain of tile(): the same bits. A masked store keeps the first nr columns. */
static inline __attribute__((always_inline)) void tile_z(const float *a, int64_t lda, const float *b, int64_t ldb,
                                                         float *c, int64_t ldc, int64_t K, const int mr, int64_t nr) {
    __m512 acc[MT];
    _Pragma("GCC unroll 12")
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m512 bk = _mm512_loadu_ps(b + k * ldb);
        _Pragma("GCC unroll 12")
        for (int i = 0; i < mr; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * lda + k]), bk, acc[i]);
    }
    const __mmask16 keep = (__mmask16)(nr >= NR ? 0xFFFFu : (1u << nr) - 1u);
    for (int i = 0; i < mr; ++i) _mm512_mask_storeu_ps(c + i * ldc, keep, acc[i]);
}

/* A tile of min(rows, MT) rows: each row count runs its own inlined copy of tile_z() (constant mr). */
static inline void tile_rows(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc,
                             int64_t K, int64_t rows, int64_t nr) {
    switch (rows < MT ? rows : MT) {
        case 12: tile_z(a, lda, b, ldb, c, ldc, K, 12, nr); break;
        case 11: tile_z(a, lda, b, ldb, c, ldc, K, 11, nr); break;
        case 10: tile_z(a, lda, b, ldb, c, ldc, K, 10, nr); break;
        case 9: tile_z(a, lda, b, ldb, c, ldc, K, 9, nr); break;
        case 8: tile_z(a, lda, b, ldb, c, ldc, K, 8, nr); break;
        case 7: tile_z(a, lda, b, ldb, c, ldc, K, 7, nr); break;
        case 6: tile_z(a, lda, b, ldb, c, ldc, K, 6, nr); break;
        case 5: tile_z(a, lda, b, ldb, c, ldc, K, 5, nr); break;
        case 4: tile_z(a, lda, b, ldb, c, ldc, K, 4, nr); break;
        case 3: tile_z(a, lda, b, ldb, c, ldc, K, 3, nr); break;
        case 2: tile_z(a, lda, b, ldb, c, ldc, K, 2, nr); break;
        default: tile_z(a, lda, b, ldb, c, ldc, K, 1, nr); break;
    }
}
#else
/* A tile of min(rows, MR) rows: each row count runs its own inlined copy of tile() (constant mr). */
static inline void tile_rows(const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc,
                             int64_t K, int64_t rows, int64_t nr) {
    switch (rows < MR ? rows : MR) {
        case 6: FULL_TILE(a, lda, b, ldb, c, ldc, K, nr); break;
        case 5: tile(a, lda, b, ldb, c, ldc, K, 5, nr); break;
        case 4: tile(a, lda, b, ldb, c, ldc, K, 4, nr); break;
        case 3: tile(a, lda, b, ldb, c, ldc, K, 3, nr); break;
        case 2: tile(a, lda, b, ldb, c, ldc, K, 2, nr); break;
        default: tile(a, lda, b, ldb, c, ldc, K, 1, nr); break;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* d[j * ldd + i] = s[i * lds + j] for an 8 x 8 block, in registers */
static inline void transpose8(const float *s, int64_t lds, float *d, int64_t ldd) {
    const __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + lds), r2 = _mm256_loadu_ps(s + 2 * lds),
                 r3 = _mm256_loadu_ps(s + 3 * lds), r4 = _mm256_loadu_ps(s + 4 * lds), r5 = _mm256_loadu_ps(s + 5 * lds),
                 r6 = _mm256_loadu_ps(s + 6 * lds), r7 = _mm256_loadu_ps(s + 7 * lds);
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

/* The blocked path's tile (blocked_bmm): rows 0 .. mr-1 of a packed k-major (ap[k * MT + i]) against a packed
   panel of b (bp[k * NR + j], zero past the last column), kc steps of each output's chain, continued from what the
   previous block stored in c (the first block: from +0). A float stored and loaded again is the same float, so every
   output is tile()'s chain, step for step: the same bits. The blocks only keep both operands in cache: a's 12 rows of
   a block in L1, b's panels in L2 (a long-K product, a weight gradient's, otherwise streams both from L3 at every
   tile). */
static inline __attribute__((always_inline)) void ptile(const float *ap, const float *bp, float *c, int64_t ldc,
                                                        int64_t kc, const int mr, int64_t nr, int first) {
    float acc[MT][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = first || j >= nr ? 0.0f : c[i * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
        const float *bk = bp + k * NR;
        _Pragma("GCC unroll 6")
        for (int i = 0; i < mr; ++i) {
            const float ai = ap[k * MT + i];
            _Pragma("GCC unroll 16")
            for (int j = 0; j < NR; ++j) acc[i][j] = __builtin_fmaf(ai, bk[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = acc[i][j];
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void ptile_z(const float *ap, const float *bp, float *c, int64_t ldc,
                                                          int64_t kc, const int mr, int64_t nr, int first) {
    const __mmask16 keep = (__mmask16)(nr >= NR ? 0xFFFFu : (1u << nr) - 1u);
    __m512 acc[MT];
    _Pragma("GCC unroll 12")
    for (int i = 0; i < MT; ++i) acc[i] = first || i >= mr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep, c + i * ldc);
    for (int64_t k = 0; k < kc; ++k) {
        const __m512 bk = _mm512_loadu_ps(bp + k * NR);
        _Pragma("GCC unroll 12")
        for (int i = 0; i < mr; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(ap[k * MT + i]), bk, acc[i]);
    }
    for (int i = 0; i < mr; ++i) _mm512_mask_storeu_ps(c + i * ldc, keep, acc[i]);
}
#define PTILE(mr) ptile_z(ap, bp, c, ldc, kc, mr, nr, first)
#define PTILE_FULL PTILE(MT)
#elif defined(__AVX2__) && defined(__FMA__)
#define ROW(i) ai = _mm256_broadcast_ss(ap + k * MT + (i)); \
               c##i##0 = _mm256_fmadd_ps(ai, b0, c##i##0); c##i##1 = _mm256_fmadd_ps(ai, b1, c##i##1);
#define LOAD(i) c##i##0 = _mm256_loadu_ps(in[i]); c##i##1 = _mm256_loadu_ps(in[i] + 8);
/* ptile() for a full MR = 6 rows in AVX2 / FMA3 intrinsics (tile6's registers): the same chains */
static inline __attribute__((always_inline)) void ptile6(const float *ap, const float *bp, float *c, int64_t ldc,
                                                         int64_t kc, int64_t nr, int first) {
    float in[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) in[i][j] = first || j >= nr ? 0.0f : c[i * ldc + j];
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51, ai;
    LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_loadu_ps(bp + k * NR), b1 = _mm256_loadu_ps(bp + k * NR + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    STORE6(c, ldc, nr);
}
#undef ROW
#undef LOAD
#define PTILE(mr) ptile(ap, bp, c, ldc, kc, mr, nr, first)
#define PTILE_FULL ptile6(ap, bp, c, ldc, kc, nr, first)
#else
#define PTILE(mr) ptile(ap, bp, c, ldc, kc, mr, nr, first)
#define PTILE_FULL PTILE(MR)
#endif

/* A packed tile of min(rows, MT) rows: each row count its own inlined copy (constant mr) */
static inline void ptile_rows(const float *ap, const float *bp, float *c, int64_t ldc, int64_t kc, int64_t rows,
                              int64_t nr, int first) {
    switch (rows < MT ? rows : MT) {
#if MT == 12
        case 12: PTILE_FULL; break;
        case 11: PTILE(11); break;
        case 10: PTILE(10); break;
        case 9: PTILE(9); break;
        case 8: PTILE(8); break;
        case 7: PTILE(7); break;
        case 6: PTILE(6); break;
#else
        case 6: PTILE_FULL; break;
#endif
        case 5: PTILE(5); break;
        case 4: PTILE(4); break;
        case 3: PTILE(3); break;
        case 2: PTILE(2); break;
        default: PTILE(1); break;
    }
}

#define KC 256 /* k steps a block */
#define MC_TILES 32 /* row tiles a chunk */
/* c[g] = a[g] @ b[g] for an a whose columns are not adjacent (a weight gradient's g.t(): K the tokens, long), k in
   blocks of KC. Per block, b's column panels are packed (kc x NR, zero-padded past N); then each chunk of row tiles
   packs its rows of a k-major (ap[tile][k][i]: reading each k's row of g along its length, not a page apart) and
   runs every panel, each output's chain continued from what the previous block stored in c. Threads share a
   block's chunks, never a chain's steps: a chain's blocks run in order (a barrier between blocks). Returns 0, or 1
   if a buffer could not be allocated. (A product of row-major operands keeps the unblocked path: it reads both in
   place, which measured faster up to K of a few thousand.) */
static int blocked_bmm(const float *a, const float *b, float *c, int64_t batch, int64_t M, int64_t K, int64_t N,
                       int64_t a_batch, int64_t lda, int64_t a_col, int64_t b_batch, int64_t ldb, int64_t b_col,
                       int threads) {
    const int64_t mt = (M + MT - 1) / MT, nt = (N + NR - 1) / NR;
    const int64_t rounds = (mt + threads * MC_TILES - 1) / (threads * MC_TILES);  /* chunks a thread, balanced */
    const int64_t chunk = (mt + threads * rounds - 1) / (threads * rounds), chunks = (mt + chunk - 1) / chunk;
    float *bp = (float *)aligned_alloc(64, (size_t)(nt * KC * NR) * sizeof(float)); /* 64-byte lines: no split loads */
    if (bp == NULL) return 1;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *ap = (float *)aligned_alloc(64, (size_t)(chunk * KC * MT) * sizeof(float));
        if (ap == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        for (int64_t g = 0; g < batch; ++g) {
            const float *ag = a + g * a_batch, *bg = b + g * b_batch;
            float *cg = c + g * M * N;
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC;
                #pragma omp for schedule(static)
                for (int64_t p = 0; p < nt; ++p) {
                    const int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
                    float *dst = bp + p * KC * NR;
                    for (int64_t k = 0; k < kc; ++k) {
                        const float *src = bg + (k0 + k) * ldb + n0 * b_col;
                        for (int64_t j = 0; j < NR; ++j) dst[k * NR + j] = j < nr ? src[j * b_col] : 0.0f;
                    }
                }  /* (the loop's barrier: every panel packed before any tile reads one) */
                #pragma omp for schedule(static)
                for (int64_t q = 0; q < chunks; ++q) {
                    if (ap == NULL) continue;
                    const int64_t r0 = q * chunk * MT, r1 = (q + 1) * chunk * MT < M ? (q + 1) * chunk * MT : M;
                    for (int64_t k = 0; k < kc; ++k) {
                        const float *src = ag + (k0 + k) * a_col + r0 * lda;
                        float *dst = ap + k * MT;
                        for (int64_t m0 = r0; m0 < r1; m0 += MT, src += MT * lda, dst += KC * MT) {
                            const int64_t mr = r1 - m0 < MT ? r1 - m0 : MT;
                            if (lda == 1 && mr == MT)
                                for (int i = 0; i < MT; ++i) dst[i] = src[i];  /* one k of a tile: adjacent */
                            else
                                for (int64_t i = 0; i < mr; ++i) dst[i] = src[i * lda];
                        }
                    }
                    for (int64_t m0 = r0; m0 < r1; m0 += MT) {
                        const int64_t mr = r1 - m0 < MT ? r1 - m0 : MT;
                        const float *at = ap + ((m0 - r0) / MT) * KC * MT;
                        for (int64_t p = 0; p < nt; ++p) {
                            const int64_t n0 = p * NR, nr = N - n0 < NR ? N - n0 : NR;
                            ptile_rows(at, bp + p * KC * NR, cg + m0 * N + n0, N, kc, mr, nr, k0 == 0);
                        }
                    }
                }  /* (and its barrier: every tile done before the next block packs over bp) */
            }
        }
        free(ap);
    }
    free(bp);
    return failed;
}

#define TB 64
/* rows[i * K + k] = a[i * lda + k * a_col] for rows i0 .. i1-1: a transposed a (lda = 1) made row-major, in TB x TB
   blocks of 8 x 8 register transposes (a plain strided copy, torch's included, runs several times slower: each
   element of a row of the result comes from another row of the source, a page apart) */
static void rows_of(const float *a, int64_t lda, int64_t a_col, float *rows, int64_t K, int64_t i0, int64_t i1) {
    for (int64_t k0 = 0; k0 < K; k0 += TB) {
        const int64_t k1 = k0 + TB < K ? k0 + TB : K;
        for (int64_t b0 = i0; b0 < i1; b0 += TB) {
            const int64_t b1 = b0 + TB < i1 ? b0 + TB : i1;
            int64_t k = k0;
#if defined(__AVX2__) && defined(__FMA__)
            if (lda == 1)
                for (; k + 8 <= k1; k += 8) {
                    int64_t i = b0;
                    for (; i + 8 <= b1; i += 8) transpose8(a + k * a_col + i, a_col, rows + i * K + k, K);
                    for (; i < b1; ++i)
                        for (int64_t q = k; q < k + 8; ++q) rows[i * K + q] = a[i + q * a_col];
                }
#endif
            for (; k < k1; ++k)
                for (int64_t i = b0; i < b1; ++i) rows[i * K + k] = a[i * lda + k * a_col];
        }
    }
}

static int fixed_order_bmm(const float *a, const float *b, float *c, int64_t batch, int64_t M, int64_t K, int64_t N,
                           int64_t a_batch, int64_t lda, int64_t b_batch, int64_t ldb, int64_t b_col,
                           int64_t b_readable, int threads);

/* c[g] = a[g] @ b[g] for g < batch; a is read through its strides (lda between rows, a_col between columns: an a
   whose columns are not adjacent, e.g. a weight gradient's g.t(), runs blocked past KC steps and is otherwise first
   made row-major by rows_of), b through its strides (b_col between columns), b_readable floats from b's start
   exist. Returns 0, or 1 if a buffer could
   not be allocated (c is then incomplete). */
int driftless_fixed_order_bmm(const float *a, const float *b, float *c, int64_t batch, int64_t M, int64_t K,
                              int64_t N, int64_t a_batch, int64_t lda, int64_t a_col, int64_t b_batch, int64_t ldb,
                              int64_t b_col, int64_t b_readable, int threads) {
    if (K > KC && a_col != 1)  /* a weight gradient's g.t() over the tokens */
        return blocked_bmm(a, b, c, batch, M, K, N, a_batch, lda, a_col, b_batch, ldb, b_col, threads);
    if (a_col == 1 || K == 1)
        return fixed_order_bmm(a, b, c, batch, M, K, N, a_batch, lda, b_batch, ldb, b_col, b_readable, threads);
    float *rows = (float *)malloc((size_t)(batch * M * K) * sizeof(float));
    if (rows == NULL) return 1;
    const int64_t mb = (M + TB - 1) / TB;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < batch * mb; ++t) {
        const int64_t g = t / mb, i0 = (t % mb) * TB;
        rows_of(a + g * a_batch, lda, a_col, rows + g * M * K, K, i0, i0 + TB < M ? i0 + TB : M);
    }
    const int failed = fixed_order_bmm(rows, b, c, batch, M, K, N, M * K, K, b_batch, ldb, b_col, b_readable,
                                       threads);
    free(rows);
    return failed;
}

static int fixed_order_bmm(const float *a, const float *b, float *c, int64_t batch, int64_t M, int64_t K, int64_t N,
                           int64_t a_batch, int64_t lda, int64_t b_batch, int64_t ldb, int64_t b_col,
                           int64_t b_readable, int threads) {
    const int64_t mt = (M + MT - 1) / MT, nt = (N + NR - 1) / NR;
    const int64_t last_row = (batch - 1) * b_batch + (K - 1) * ldb;
    if (b_col == 1 && last_row + nt * NR <= b_readable) {
        /* b read in place. Tiles in blocks of MB rows: a block's rows of a stay in cache while every
           column panel passes */
        const int64_t per = mt * nt, tiles = batch * per, mb = MB / MT;
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t g = t / per, r = t % per;
            const int64_t blk = r / (mb * nt), rb = r % (mb * nt);
            const int64_t in_blk = mt - blk * mb < mb ? mt - blk * mb : mb;
            const int64_t ni = rb / in_blk, mi = blk * mb + rb % in_blk;
            const int64_t m0 = mi * MT, n0 = ni * NR;
            const float *at = a + g * a_batch + m0 * lda, *bt = b + g * b_batch + n0;
            float *ct = c + g * M * N + m0 * N + n0;
            tile_rows(at, lda, bt, ldb, ct, N, K, M - m0, N - n0 < NR ? N - n0 : NR);
        }
        return 0;
    }
    /* b strided (a transposed matrix) or not readable past its last column: each column panel is
       first copied into a zero-padded K x NR buffer of the thread's, then every row tile runs on it */
    int failed = 0;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *panel = (float *)malloc((size_t)K * NR * sizeof(float));
        if (panel == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < batch * nt; ++t) {
            if (panel == NULL) continue;
            const int64_t g = t / nt, n0 = (t % nt) * NR;
            const int64_t nr = N - n0 < NR ? N - n0 : NR;
            const float *bg = b + g * b_batch + n0 * b_col;
            for (int64_t k = 0; k < K; ++k)
                for (int64_t j = 0; j < NR; ++j) panel[k * NR + j] = j < nr ? bg[k * ldb + j * b_col] : 0.0f;
            for (int64_t m0 = 0; m0 < M; m0 += MT)
                tile_rows(a + g * a_batch + m0 * lda, lda, panel, NR, c + g * M * N + m0 * N + n0, N, K, M - m0, nr);
        }
        free(panel);
    }
    return failed;
}
"""

# below this many multiply-adds one thread does the work (a parallel region costs more than it saves)
_PARALLEL_MIN_FMAS = 1 << 18

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failure: str | None = None  # why the compiled kernel is unavailable here, once known


def _flags() -> list[str]:
    # the bits do not depend on these (module docstring); they only let the compiler use FMA3 and
    # 256-bit vectors where ATen reports at least AVX2 (every x86-64 machine this project targets), and
    # 512-bit ones where it reports AVX-512 (ATEN_CPU_CAPABILITY=avx2 builds the AVX2 kernel there)
    capability = torch.backends.cpu.get_cpu_capability()
    isa = ["-mavx2", "-mfma"] if capability in ("AVX2", "AVX512") else []
    isa += ["-mavx512f"] if capability == "AVX512" else []
    return ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared", *isa]


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "driftless", "fixed_mm")


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    flags = _flags()
    tag = hashlib.sha256("\0".join([_SOURCE, compiler, *flags]).encode()).hexdigest()[:16]
    folder = _cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:  # no writable home: a folder of this process's own
        folder = tempfile.mkdtemp(prefix="driftless-fixed-mm-")
    path = os.path.join(folder, f"fixed_mm-{tag}.so")
    if not os.path.exists(path):
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src = os.path.join(tmp, "fixed_mm.c")
            with open(src, "w") as f:
                f.write(_SOURCE)
            out = os.path.join(tmp, "fixed_mm.so")
            done = subprocess.run([compiler, *flags, src, "-o", out], check=False, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {(done.stderr.strip().splitlines() or [''])[0][:200]}")
            os.replace(out, path)  # atomic: a concurrent build of the same source writes the same file
    lib = ctypes.CDLL(path)
    fn = lib.driftless_fixed_order_bmm
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 11 + [ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib


def _native() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (warned once) where it cannot build."""
    global _lib, _failure
    if _lib is not None or _failure is not None:
        return _lib
    with _lock:
        if _lib is None and _failure is None:
            try:
                _lib = _build()
            except Exception as err:  # noqa: BLE001 - any build failure means: the reference, said once
                _failure = f"{type(err).__name__}: {err}"
                warnings.warn(f"driftless: the fixed-order GEMM kernel cannot build here ({_failure}); using its "
                              f"PyTorch reference (the same bits, much slower)", RuntimeWarning, stacklevel=4)
    return _lib


def kernel_failure() -> str | None:
    """Why the compiled kernel is unavailable here (None if it built or was not needed yet)."""
    return _failure


def _choice() -> str:
    value = os.environ.get(ENV, "native")
    if value not in ("native", "reference"):
        raise ValueError(f"{ENV} must be 'native' or 'reference', got {value!r}")
    return value


def fixed_order_mm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fma chain of ``fixed_order_mm`` in PyTorch operations: one step per ``k`` over all outputs.

    ``a·b`` of two floats is exact in float64; ``s = a·b + acc`` is rounded to nearest there, and
    TwoSum gives its exact error. Replacing an inexact ``s`` by the neighbour with an odd last bit
    (rounding to odd) and then rounding once to float32 gives the correctly rounded ``fma`` (53 ≥
    24 + 2 bits). Finite values only (an overflow to ±inf agrees; NaN payloads are not compared).
    """
    a64, b64 = a.double(), b.double()
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for k in range(a.shape[1]):
        p = a64[:, k:k + 1] * b64[k]  # exact: 24 + 24 significand bits
        c = acc.double()
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)  # TwoSum: s + err == p + c exactly
        even = (s.view(torch.int64) & 1) == 0
        odd_neighbour = torch.nextafter(s, torch.where(err > 0, inf, -inf))
        acc = torch.where((err != 0) & even, odd_neighbour, s).float()
    return acc


_NR = 16  # the kernel's tile width: it reads every row of b up to a multiple of this many columns


def _row_stride(n: int) -> int:
    """A row stride for ``n`` columns: a multiple of the tile width and an odd number of 64-byte lines.

    An even number (a power of two above all: 512 or 1024 floats) maps a tile's rows of b onto few
    cache sets, which evict each other (1.6× slower at N = 1024 on an EPYC, measured once).
    """
    stride = -(-n // _NR) * _NR
    return stride if (stride // _NR) % 2 else stride + _NR


def gemm_layout(b: torch.Tensor) -> torch.Tensor:
    """``b [K, N]`` copied into zero-padded rows, the layout the kernel reads fastest (``linear_weight`` keeps weights so).

    The kernel reads any strides (a transposed or sliced ``b`` is copied panel by panel inside it),
    but a row-major ``b`` whose rows are readable up to the next multiple of 16 columns is read in
    place, and a row stride of an odd number of cache lines keeps a tile's rows in different cache sets.
    """
    n = b.shape[-1]
    buf = b.new_zeros(*b.shape[:-1], _row_stride(n), dtype=torch.float32)
    buf[..., :n] = b
    return buf[..., :n]


def _run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N]`` (or 2-D without G) by the kernel, else by the reference."""
    lib = _native() if _choice() == "native" else None
    if lib is None:
        if a.dim() == 2:
            return fixed_order_mm_reference(a, b)
        return torch.stack([fixed_order_mm_reference(x, y) for x, y in zip(a, b)]) if len(a) else \
            a.new_empty(0, a.shape[1], b.shape[2])
    g = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    n = b.shape[-1]
    c = torch.empty(*a.shape[:-1], n, dtype=torch.float32)
    if g and m and n and not k:
        c.zero_()  # a chain of no steps: its starting +0
    elif g and m and n:
        a_batch = a.stride(0) if a.dim() == 3 else 0
        b_batch = b.stride(0) if b.dim() == 3 else 0
        readable = b.untyped_storage().nbytes() // 4 - b.storage_offset()  # floats from b's first
        threads = torch.get_num_threads() if g * m * n * k >= _PARALLEL_MIN_FMAS else 1
        if lib.driftless_fixed_order_bmm(a.data_ptr(), b.data_ptr(), c.data_ptr(), g, m, k, n, a_batch, a.stride(-2),
                                         a.stride(-1), b_batch, b.stride(-2), b.stride(-1), readable, threads):
            raise MemoryError(f"fixed_order_bmm: no memory for a {k} x {_NR} panel of b or a row-major copy of a")
    return c


# The op compiled graphs call (eager code calls ``_run`` directly). Registered with the low-level
# Library API, a CPU kernel and a fake (shape) kernel: a lighter dispatch than a
# ``torch.library.custom_op``'s (about half, timed once), which matters at decode sizes. No autograd kernel: compiled aligned
# pieces run without gradients (``ops.fuse``).
_LIB = torch.library.Library("driftless", "DEF")  # kept alive for the process
_LIB.define("fixed_order_bmm(Tensor a, Tensor b) -> Tensor")
_LIB.impl("fixed_order_bmm", _run, "CPU")


@torch.library.register_fake("driftless::fixed_order_bmm")
def _(a, b):
    return a.new_empty(a.shape[0], a.shape[1], b.shape[2])


def _fixed_order_bmm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.driftless.fixed_order_bmm(a, b)


def _check(a: torch.Tensor, b: torch.Tensor, dims: int, name: str, shapes: str) -> None:
    if a.dim() != dims or b.dim() != dims or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"{name} takes {shapes}, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.float32 or b.dtype != torch.float32 or a.device.type != "cpu" or b.device.type != "cpu":
        raise ValueError(f"{name} takes float32 CPU tensors, got {a.dtype} on {a.device} and "
                         f"{b.dtype} on {b.device}")


def fixed_order_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` in float32 (CPU), every output one fma chain in k order: the same bits on any machine.

    No gradient (aligned pieces supply their own backward). Inside ``torch.compile`` it is one opaque op.
    """
    _check(a, b, 2, "fixed_order_mm", "a [M, K] and b [K, N]")
    if torch.compiler.is_compiling():  # one opaque op in the graph
        return _fixed_order_bmm_op(a[None], b[None])[0]
    return _run(a.detach(), b.detach())  # eager: the kernel directly (the op's dispatch costs more than a small GEMM)


def fixed_order_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [G, M, K] @ b [G, K, N]``: ``fixed_order_mm`` for each of the G pairs (one call, threads across all)."""
    _check(a, b, 3, "fixed_order_bmm", "a [G, M, K] and b [G, K, N]")
    if torch.compiler.is_compiling():
        return _fixed_order_bmm_op(a, b)
    return _run(a.detach(), b.detach())
