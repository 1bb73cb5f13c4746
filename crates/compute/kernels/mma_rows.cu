// One matrix times a batch of B input rows on tensor cores (batched decode, prefill's exact
// mode): y[b, n] = Σ_k W[n, k] x[b, k] (+ bias[n]), at the accuracy and in the fragment layout of
// mma_frag.cuh (prefixed to this file). The wide form is in mma_wide.cu.
//
// Per 32-wide K chunk c, k = 32c + 8t + 0..7 (t = lane % 4): lane l holds the 8 values of weight
// rows l/4 and l/4 + 8 and of input row l/4 of each 8-row tile; the mma's k slots 2t, 2t+1,
// 2t+8, 2t+9 of its two k16 steps are mapped to these k (any consistent mapping gives the same
// sum). With groups of 16 (8-bit codes, AFFINE_G16 builds) a lane's 8 values are instead k =
// 32c + 4t + 0..3 (step 0: the chunk's first group; at 8 bits word t of the chunk) and 32c + 16
// + 4t + 0..3 (step 1, the second group: word 4 + t), and each step's partials take their group's
// scale and bias.
//
// Forms, each described at its kernels: split-K (below; small decode batches), GEMM (prefill's
// exact mode), grouped (prefill's experts by expert) and grouped split-K (decode batches'
// experts by expert).
//
// GEMM form (many inputs: prefill's exact mode, from 512 rows; mma_gemm_*): grid (ceil(B / 32),
// ceil(N / 128)), block 256: the block's 32 inputs are staged per 32-wide K chunk in shared
// memory as bf16 hi/lo (converted once for all warps, with their per-chunk sums), and warp w
// takes weight rows blockIdx.y·128 + 16w + 0..16 over the whole K.
//
// Grouped form (MoE prefill, pairs sorted by expert by `moe_group` in prefill.cu), GEMM layout:
// block x is tile blockIdx.x of `tiles` (int3: expert e, first index f into `order`, count ≤ 32;
// blocks past n_tiles exit); its input rows are pairs p = order[f + i], read at
// x + (p / x_div)·x_stride, the weights are expert e's of a stack [E, N, K] ([E, 2I, K] for
// SwiGLU), and output row p of y [pairs, N].
//
// Split-K form (mma_rows_*, mma_swiglu_*): grid (ceil(B / 32), ceil(N / 16)) (N = I for
// SwiGLU), block 256: a block takes weight rows blockIdx.y·16 + 0..16 and input rows
// blockIdx.x·32 + 0..32 (four 8-row tiles); its 8 warps split K (warp w takes the 32-wide
// chunks c ≡ w mod 8) and are summed in shared memory.

// Codes q0, q1 < 256 as bf16x2 (exact: 8 significant bits).
__device__ __forceinline__ unsigned codes_bf16(unsigned q0, unsigned q1, int bits) {
    return bits == 4 ? codes4_bf16(q0, q1) : pack_bf16((float)q0, (float)q1);
}

// The raw data of 8 values of one weight row: bf16 values (four words), or affine words (one at
// 4 bits, two at 8) with the scale and bias of their group (16-bit ones in one word, f32 ones in
// two; with groups of 16 also s2, b2: the chunk's second group).
template <int BITS>
struct WRaw {
    unsigned v[BITS == 16 ? 4 : BITS / 4];
#if defined(AFFINE_F32)
    aff_t s, b, s2, b2;
#else
    unsigned sb;
#endif
};

// The (scale, bias) of a fragment's two rows in each set: [0] for the chunk's group, or with
// groups of 16 [st] for k16 step st's.
template <int SETS>
struct RowParams {
    float sc[2][SETS][2], bi[2][SETS][2];
};

// Loads weight row `row` at k = k0..k0+8, k0 = 32c + 8t (see WRaw; groups of 16: the values of
// the header's mapping).
template <int BITS, bool G16>
__device__ __forceinline__ void fetch_w(const void* __restrict__ W, const aff_t* __restrict__ S,
                                        const aff_t* __restrict__ Bs, long long row, int K, int k0,
                                        int gshift, WRaw<BITS>& r) {
    if constexpr (BITS == 16) {
        uint4 v = __ldcs(reinterpret_cast<const uint4*>(reinterpret_cast<const bf16_t*>(W) + row * K + k0));
        r.v[0] = v.x; r.v[1] = v.y; r.v[2] = v.z; r.v[3] = v.w;
    } else if constexpr (G16) {
#if AFFINE_G16
        const int c = k0 & ~31, t = (k0 >> 3) & 3;
        const unsigned* w = reinterpret_cast<const unsigned*>(W) + row * (K / 4) + c / 4;
        r.v[0] = __ldcs(w + t);
        r.v[1] = __ldcs(w + 4 + t);
        long long g = row * (K >> 4) + (c >> 4);
        r.s = S[g];
        r.b = Bs[g];
        r.s2 = S[g + 1];
        r.b2 = Bs[g + 1];
#endif
    } else {
        const unsigned* w = reinterpret_cast<const unsigned*>(W) + row * (K * BITS / 32) + k0 * BITS / 32;
        r.v[0] = __ldcs(w);
        if constexpr (BITS == 8) r.v[1] = __ldcs(w + 1);
        long long g = row * (K >> gshift) + (k0 >> gshift);
#if defined(AFFINE_F32)
        r.s = S[g];
        r.b = Bs[g];
#else
        r.sb = (unsigned)S[g] | ((unsigned)Bs[g] << 16);
#endif
    }
}

// The 8 values of `r` as 4 bf16x2 pairs (affine: the integer codes), and for affine rows the
// (scale, bias) of their group (sc[0], bi[0]; groups of 16: also the second group's).
template <int BITS, bool G16>
__device__ __forceinline__ void decode_w(const WRaw<BITS>& r, unsigned p[4], float sc[2], float bi[2]) {
    if constexpr (BITS == 16) {
        p[0] = r.v[0]; p[1] = r.v[1]; p[2] = r.v[2]; p[3] = r.v[3];
    } else {
        const unsigned mask = (1u << BITS) - 1u;
        unsigned lo = r.v[0], hi = lo >> 16;
        if constexpr (BITS == 8) hi = r.v[1];
        if constexpr (BITS == 4) lo &= 0xffffu;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            unsigned part = i == 0 ? lo : hi;
            const int sh = BITS;
            p[2 * i] = codes_bf16(part & mask, (part >> sh) & mask, BITS);
            p[2 * i + 1] = codes_bf16((part >> (2 * sh)) & mask, (part >> (3 * sh)) & mask, BITS);
        }
#if defined(AFFINE_F32)
        sc[0] = aff_scale(r.s);
        bi[0] = aff_bias(r.b, sc[0]);
        if constexpr (G16) {
            sc[1] = aff_scale(r.s2);
            bi[1] = aff_bias(r.b2, sc[1]);
        }
#else
        sc[0] = aff_scale((aff_t)(r.sb & 0xffffu));
        bi[0] = aff_bias((aff_t)(r.sb >> 16), sc[0]);
#endif
    }
}

// The A fragments of rows r0 and r1 of every set (set s at s·set_off) at k0, with the
// (scale, bias) of their group(s) for affine weights: every row's words are loaded, then decoded.
template <int BITS, int SETS, bool G16>
__device__ __forceinline__ void load_sets(const void* __restrict__ W, const aff_t* __restrict__ S,
                                          const aff_t* __restrict__ Bs, long long r0, long long r1,
                                          long long set_off, int K, int k0, int gshift, unsigned a[SETS][2][4],
                                          RowParams<SETS>& pr) {
    WRaw<BITS> r[SETS][2];
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        fetch_w<BITS, G16>(W, S, Bs, s * set_off + r0, K, k0, gshift, r[s][0]);
        fetch_w<BITS, G16>(W, S, Bs, s * set_off + r1, K, k0, gshift, r[s][1]);
    }
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sc[2], bi[2];
            decode_w<BITS, G16>(r[s][h], a[s][h], sc, bi);
#pragma unroll
            for (int st = 0; st < (G16 ? 2 : 1); ++st) {
                pr.sc[st][s][h] = sc[st];
                pr.bi[st][s][h] = bi[st];
            }
        }
}

// Input tile j (its bf16 hi and lo pairs) through k16 step st of set s: into acc for bf16
// weights, into the group partials for affine codes. Step st takes values 4·st .. 4·st + 3
// (pairs a[s][..][2·st], a[s][..][2·st + 1], hi[2·st], hi[2·st + 1]).
template <int BITS, int SETS, int MT>
__device__ __forceinline__ void mma_one(const unsigned a[SETS][2][4], const unsigned hi[4], const unsigned lo[4],
                                        int j, int s, int st, float acc[SETS][MT][4], float part[SETS][MT][4]) {
    float* d = BITS == 16 ? acc[s][j] : part[s][j];
    unsigned a0 = a[s][0][2 * st], a1 = a[s][1][2 * st];
    unsigned a2 = a[s][0][2 * st + 1], a3 = a[s][1][2 * st + 1];
    mma_bf16(d, a0, a1, a2, a3, hi[2 * st], hi[2 * st + 1]);
    mma_bf16(d, a0, a1, a2, a3, lo[2 * st], lo[2 * st + 1]);
}

// Input tile j through both k16 steps of every set (mma_one).
template <int BITS, int SETS, int MT>
__device__ __forceinline__ void mma_sets(const unsigned a[SETS][2][4], const unsigned hi[4], const unsigned lo[4],
                                         int j, float acc[SETS][MT][4], float part[SETS][MT][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
        for (int st = 0; st < 2; ++st) mma_one<BITS, SETS, MT>(a, hi, lo, j, s, st, acc, part);
}

// Groups of 16: input tile j through step st of every set, then the step's group folded in
// (its partials with pr's scales and biases of step st and the group sums x0, x1 of the
// fragment's inputs 2t, 2t + 1).
template <int SETS, int MT>
__device__ __forceinline__ void mma_group16(const unsigned a[SETS][2][4], const unsigned hi[4], const unsigned lo[4],
                                            int j, int st, const RowParams<SETS>& pr, float x0, float x1,
                                            float acc[SETS][MT][4], float part[SETS][MT][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) mma_one<8, SETS, MT>(a, hi, lo, j, s, st, acc, part);
    flush_tile<SETS>(pr.sc[st], pr.bi[st], x0, x1, j, acc, part);
}

// Stages four inputs `f` of a chunk for every warp of the block: as bf16 hi and lo pairs at
// hi[4·sq], lo[4·sq] of their input row, and, for affine weights, the row's chunk sum (the 8
// threads sq = 0..7 of a row are adjacent lanes) into sum[0] by thread sq = 0; with groups of 16
// the sums of its two groups into sum[0] and sum[1] by threads sq = 0 and 4.
template <int BITS, bool G16>
__device__ __forceinline__ void stage_inputs(float4 f, bf16_t* hi, bf16_t* lo, float* sum, int sq) {
    unsigned h0 = pack_bf16(f.x, f.y), h1 = pack_bf16(f.z, f.w);
    unsigned l0 = pack_bf16(f.x - bf16lo(h0), f.y - bf16hi(h0));
    unsigned l1 = pack_bf16(f.z - bf16lo(h1), f.w - bf16hi(h1));
    *reinterpret_cast<uint2*>(&hi[4 * sq]) = make_uint2(h0, h1);
    *reinterpret_cast<uint2*>(&lo[4 * sq]) = make_uint2(l0, l1);
    if (BITS != 16) {
        float su = (f.x + f.y) + (f.z + f.w);
        su += __shfl_xor_sync(0xffffffffu, su, 1);
        su += __shfl_xor_sync(0xffffffffu, su, 2);
        if (G16) {
            if ((sq & 3) == 0) sum[sq >> 2] = su;
            return;
        }
        su += __shfl_xor_sync(0xffffffffu, su, 4);
        if (sq == 0) *sum = su;
    }
}

// One chunk's products for a warp against the staged inputs (input b's hi and lo at xh, xl +
// b·ld, its chunk sum at xsum[b], with groups of 16 its groups' at xsum[2b], xsum[2b + 1]; nb
// inputs): every tile's mma pairs into acc (bf16 weights) or the partials, then, for affine
// weights, the dequant form with the chunk's (scale, bias); with groups of 16 so for each step.
template <int BITS, int SETS, bool G16>
__device__ __forceinline__ void mma_staged(const unsigned a[SETS][2][4], const RowParams<SETS>& pr,
                                           const bf16_t* xh, const bf16_t* xl, int ld, const float* xsum,
                                           int nb, float acc[SETS][MMA_TILES][4],
                                           float part[SETS][MMA_TILES][4]) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    if constexpr (G16) {
#pragma unroll
        for (int st = 0; st < 2; ++st)
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j) {
                if (j * 8 >= nb) break;
                const int b = j * 8 + gid, at = b * ld + 16 * st + 4 * t;
                uint2 hv = *reinterpret_cast<const uint2*>(&xh[at]);
                uint2 lv = *reinterpret_cast<const uint2*>(&xl[at]);
                unsigned hi[4] = {hv.x, hv.y, hv.x, hv.y}, lo[4] = {lv.x, lv.y, lv.x, lv.y};
                const float* su = &xsum[2 * (j * 8 + 2 * t) + st];
                mma_group16<SETS, MMA_TILES>(a, hi, lo, j, st, pr, su[0], su[2], acc, part);
            }
        return;
    }
#pragma unroll
    for (int j = 0; j < MMA_TILES; ++j) {
        if (j * 8 >= nb) break;
        const int b = j * 8 + gid;
        uint4 hv = *reinterpret_cast<const uint4*>(&xh[b * ld + 8 * t]);
        uint4 lv = *reinterpret_cast<const uint4*>(&xl[b * ld + 8 * t]);
        unsigned hi[4] = {hv.x, hv.y, hv.z, hv.w}, lo[4] = {lv.x, lv.y, lv.z, lv.w};
        mma_sets<BITS, SETS>(a, hi, lo, j, acc, part);
    }
    if (BITS != 16) {
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j) {
            if (j * 8 >= nb) break;
            flush_tile<SETS>(pr.sc[0], pr.bi[0], xsum[j * 8 + 2 * t], xsum[j * 8 + 2 * t + 1], j, acc, part);
        }
    }
}

// Accumulates, for one warp, rows base + n0..n0+16 (and, with `SETS` 2, rows base + N + n0.. as
// the second output set) against input rows 0..8·MT into acc[set][tile][4] (mma C layout: rows
// l/4, l/4 + 8, inputs 2(l%4), 2(l%4)+1 of the tile). Input b is at x + b·xs, or at
// x + rows[b]·xs. The warp takes the 32-wide K chunks c ≡ kw (mod ks); the next chunk's weights
// load while the current chunk's products run.
template <int BITS, int SETS, int MT, bool G16>
__device__ void mma_rows_core(const void* __restrict__ W, const aff_t* __restrict__ S,
                              const aff_t* __restrict__ Bs, const float* x, long long xs, const int* rows,
                              int nb, int N, int K, int G, long long base, int n0, int kw, int ks,
                              float acc[SETS][MT][4]) {
    int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    int gshift = __ffs(G) - 1;
    long long r0 = base + min(n0 + gid, N - 1), r1 = base + min(n0 + gid + 8, N - 1);
    float part[SETS][MT][4];
    zero_frags<SETS>(acc, part);
    float xsum[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) xsum[j] = 0.f;
    const float* xr[MT];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        int b = j * 8 + gid;
        xr[j] = b < nb ? x + (rows ? rows[b] : b) * xs : nullptr;
    }
    // Where the lane's second run of 4 inputs starts after its first (header).
    const int x1 = G16 ? 16 : 4;
    const int step = 32 * ks;
    int c = 32 * kw;
    unsigned a[SETS][2][4];
    RowParams<SETS> pr;
    if (c < K) load_sets<BITS, SETS, G16>(W, S, Bs, r0, r1, N, K, c + 8 * t, gshift, a, pr);
    for (; c < K; c += step) {
        int k0 = c + 8 * t;
        unsigned an[SETS][2][4];
        RowParams<SETS> prn;
        const bool more = c + step < K;
        if (more) load_sets<BITS, SETS, G16>(W, S, Bs, r0, r1, N, K, k0 + step, gshift, an, prn);
#pragma unroll
        for (int j = 0; j < MT; ++j) {
            if (j * 8 >= nb) break;
            float xv[8];
            if (xr[j]) {
                const float* xk = xr[j] + (G16 ? c + 4 * t : k0);
                float4 f0 = *reinterpret_cast<const float4*>(xk);
                float4 f1 = *reinterpret_cast<const float4*>(xk + x1);
                xv[0] = f0.x; xv[1] = f0.y; xv[2] = f0.z; xv[3] = f0.w;
                xv[4] = f1.x; xv[5] = f1.y; xv[6] = f1.z; xv[7] = f1.w;
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) xv[i] = 0.f;
            }
            unsigned hi[4], lo[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                hi[i] = pack_bf16(xv[2 * i], xv[2 * i + 1]);
                lo[i] = pack_bf16(xv[2 * i] - bf16lo(hi[i]), xv[2 * i + 1] - bf16hi(hi[i]));
            }
            if constexpr (G16) {
                // A group a step: each step's partials are folded in with its group's sums.
#pragma unroll
                for (int st = 0; st < 2; ++st) {
                    float gx0, gx1;
                    quad_sums((xv[4 * st] + xv[4 * st + 1]) + (xv[4 * st + 2] + xv[4 * st + 3]), gx0, gx1);
                    mma_group16<SETS, MT>(a, hi, lo, j, st, pr, gx0, gx1, acc, part);
                }
                continue;
            }
            if (BITS != 16)
#pragma unroll
                for (int i = 0; i < 8; ++i) xsum[j] += xv[i];
            mma_sets<BITS, SETS>(a, hi, lo, j, acc, part);
        }
        if (BITS != 16 && !G16) {
            // Each lane summed its 8 inputs of row gid; the quad holds the row's chunk sum.
#pragma unroll
            for (int j = 0; j < MT; ++j) {
                if (j * 8 >= nb) break;
                float gx0, gx1;
                quad_sums(xsum[j], gx0, gx1);
                flush_tile<SETS>(pr.sc[0], pr.bi[0], gx0, gx1, j, acc, part);
                xsum[j] = 0.f;
            }
        }
        if (more) {
#pragma unroll
            for (int s2 = 0; s2 < SETS; ++s2)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int st = 0; st < (G16 ? 2 : 1); ++st) {
                        pr.sc[st][s2][h] = prn.sc[st][s2][h];
                        pr.bi[st][s2][h] = prn.bi[st][s2][h];
                    }
#pragma unroll
                    for (int i = 0; i < 4; ++i) a[s2][h][i] = an[s2][h][i];
                }
        }
    }
}

// Sums the fragments of each run of `ks` warps (w / ks alike) into its first warp's (through
// shared memory); ks divides 8.
template <int SETS, int MT>
__device__ void reduce_warps(float acc[SETS][MT][4], int ks) {
    __shared__ float red[8][SETS * MT * 4][32];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (w % ks != 0)
#pragma unroll
        for (int s = 0; s < SETS; ++s)
#pragma unroll
            for (int j = 0; j < MT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[w][(s * MT + j) * 4 + e][lane] = acc[s][j][e];
    __syncthreads();
    if (w % ks == 0)
        for (int o = w + 1; o < w + ks; ++o)
#pragma unroll
            for (int s = 0; s < SETS; ++s)
#pragma unroll
                for (int j = 0; j < MT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[s][j][e] += red[o][(s * MT + j) * 4 + e][lane];
}

// The split-K form: the block's 8 warps split K for one 16-row tile, then warp 0 stores.
template <int BITS, int SETS, bool G16 = false>
__device__ void mma_split_t(const void* W, const aff_t* S, const aff_t* Bs, const float* x, float* y,
                            int N, int K, int G, int Bn, long long xs, const float* bias) {
    int n0 = blockIdx.y * 16;
    int b0 = blockIdx.x * 8 * MMA_TILES;
    float acc[SETS][MMA_TILES][4];
    mma_rows_core<BITS, SETS, MMA_TILES, G16>(W, S, Bs, x + b0 * xs, xs, nullptr, Bn - b0, N, K, G, 0, n0,
                                              threadIdx.x >> 5, 8, acc);
    reduce_warps<SETS>(acc, 8);
    if (threadIdx.x >= 32) return;
    store_frags<SETS>(acc, y, N, n0, Bn - b0, nullptr, b0, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                float* __restrict__ y, int N, int K, int Bn, long long xs,
                                                                const float* __restrict__ bias) {
    pdl_entry();
    mma_split_t<16, 1>(W, nullptr, nullptr, x, y, N, K, 32, Bn, xs, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_swiglu_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                  float* __restrict__ h, int I, int K, int Bn, long long xs) {
    pdl_entry();
    mma_split_t<16, 2>(W, nullptr, nullptr, x, h, I, K, 32, Bn, xs, nullptr);
}

// Row stride (bf16) of the staged input tile: 32 values + 8 of padding against bank conflicts.
#define XS_PAD 40

// The GEMM form's accumulation for one warp: weight rows base + s·set_off + min(r + 0..16,
// N − 1) of each set s against the block's nb ≤ 32 inputs (row b at x + b·xs, or x +
// rows[b]·xs), staged per chunk in shared memory by all 256 threads. acc as mma_rows_core.
template <int BITS, int SETS, bool G16>
__device__ void mma_gemm_core(const void* __restrict__ W, const aff_t* __restrict__ S,
                              const aff_t* __restrict__ Bs, const float* x, long long xs,
                              const int* rows, int nb, int N, int K, int G, long long set_off,
                              long long base, int r, float acc[SETS][MMA_TILES][4]) {
    __shared__ __align__(16) bf16_t xh[32 * XS_PAD], xl[32 * XS_PAD];
    __shared__ float xsum[G16 ? 64 : 32];
    int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    int gshift = __ffs(G) - 1;
    long long r0 = base + min(r + gid, N - 1), r1 = base + min(r + gid + 8, N - 1);
    float part[SETS][MMA_TILES][4];
    zero_frags<SETS>(acc, part);
    // Staging: thread i converts values 4·(i % 8) .. + 4 of input i / 8.
    int sb = threadIdx.x >> 3, sq = threadIdx.x & 7;
    const float* sx = sb < nb ? x + (rows ? rows[sb] : sb) * xs : nullptr;
    for (int c = 0; c < K; c += 32) {
        __syncthreads();
        float4 f = sx ? *reinterpret_cast<const float4*>(sx + c + 4 * sq) : make_float4(0.f, 0.f, 0.f, 0.f);
        stage_inputs<BITS, G16>(f, &xh[sb * XS_PAD], &xl[sb * XS_PAD], &xsum[G16 ? 2 * sb : sb], sq);
        __syncthreads();
        int k0 = c + 8 * t;
        unsigned a[SETS][2][4];
        RowParams<SETS> pr;
        load_sets<BITS, SETS, G16>(W, S, Bs, r0, r1, set_off, K, k0, gshift, a, pr);
        mma_staged<BITS, SETS, G16>(a, pr, xh, xl, XS_PAD, xsum, nb, acc, part);
    }
}

template <int BITS, int SETS, bool G16 = false>
__device__ void mma_gemm_t(const void* W, const aff_t* S, const aff_t* Bs, const float* x, float* y,
                           int N, int K, int G, int Bn, long long xs, const float* bias) {
    int r = blockIdx.y * 128 + (threadIdx.x >> 5) * 16;
    int b0 = blockIdx.x * 8 * MMA_TILES;
    float acc[SETS][MMA_TILES][4];
    mma_gemm_core<BITS, SETS, G16>(W, S, Bs, x + b0 * xs, xs, nullptr, Bn - b0, N, K, G, N, 0, r, acc);
    store_frags<SETS>(acc, y, N, r, Bn - b0, nullptr, b0, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_gemm_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                     float* __restrict__ y, int N, int K, int Bn, long long xs,
                                                                     const float* __restrict__ bias) {
    pdl_entry();
    mma_gemm_t<16, 1>(W, nullptr, nullptr, x, y, N, K, 32, Bn, xs, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_gemm_swiglu_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                       float* __restrict__ h, int I, int K, int Bn, long long xs) {
    pdl_entry();
    mma_gemm_t<16, 2>(W, nullptr, nullptr, x, h, I, K, 32, Bn, xs, nullptr);
}

// The grouped form's tile: its expert, pairs and input rows (pair / x_div); false past n_tiles.
__device__ __forceinline__ bool mma_tile(const int* tiles, const int* n_tiles,
                                         const int* order, int x_div, int& e, int& nb,
                                         int pair[MMA_TILES * 8], int row[MMA_TILES * 8]) {
    int ti = blockIdx.x;
    if (ti >= n_tiles[0]) return false;
    e = tiles[3 * ti];
    int f = tiles[3 * ti + 1];
    nb = tiles[3 * ti + 2];
#pragma unroll
    for (int i = 0; i < MMA_TILES * 8; ++i) {
        pair[i] = i < nb ? order[f + i] : 0;
        row[i] = pair[i] / x_div;
    }
    return true;
}

template <int BITS, int SETS, bool G16 = false>
__device__ void mma_grouped_t(const void* W, const aff_t* S, const aff_t* Bs, const float* x, float* y,
                              int N, int K, int G, const int* tiles, const int* n_tiles, const int* order,
                              long long xs, int x_div) {
    __shared__ int pair[MMA_TILES * 8], row[MMA_TILES * 8];
    __shared__ int tile_e, tile_n;
    if (threadIdx.x == 0) {
        int e, nb, p[MMA_TILES * 8], r[MMA_TILES * 8];
        bool ok = mma_tile(tiles, n_tiles, order, x_div, e, nb, p, r);
        tile_e = e;
        tile_n = ok ? nb : 0;
        for (int i = 0; i < MMA_TILES * 8; ++i) {
            pair[i] = p[i];
            row[i] = r[i];
        }
    }
    __syncthreads();
    int nb = tile_n;
    if (nb == 0) return;
    long long base = (long long)tile_e * SETS * N;
    int r = blockIdx.y * 128 + (threadIdx.x >> 5) * 16;
    float acc[SETS][MMA_TILES][4];
    mma_gemm_core<BITS, SETS, G16>(W, S, Bs, x, xs, row, nb, N, K, G, N, base, r, acc);
    store_frags<SETS>(acc, y, N, r, nb, pair, 0, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) mma_grouped_rows_bf16(
    const bf16_t* __restrict__ W, const float* x, float* __restrict__ y, int N, int K,
    const int* tiles, const int* n_tiles, const int* order,
    long long xs, int x_div) {
    pdl_entry();
    mma_grouped_t<16, 1>(W, nullptr, nullptr, x, y, N, K, 32, tiles, n_tiles, order, xs, x_div);
}

extern "C" __global__ void __launch_bounds__(256) mma_grouped_swiglu_bf16(
    const bf16_t* __restrict__ W, const float* x, float* __restrict__ h, int I, int K,
    const int* tiles, const int* n_tiles, const int* order,
    long long xs, int x_div) {
    pdl_entry();
    mma_grouped_t<16, 2>(W, nullptr, nullptr, x, h, I, K, 32, tiles, n_tiles, order, xs, x_div);
}

// Grouped split-K form (MoE decode batches: few pairs per expert): tiles of `tiles` as in the
// grouped form but with count ≤ 8·MT, block x taking tiles blockIdx.x, blockIdx.x + gridDim.x, …
// (a grid sized for the tiles expected, not the most possible). Block y takes weight rows
// blockIdx.y·16·(8/ks) + 0..16·(8/ks) (outputs of `[gate | up]` for SwiGLU) of the tile's
// expert: warp w takes rows 16·(w / ks) + 0..16 and the K chunks c ≡ w mod ks (ks ∈ {1, 2, 4,
// 8}), the ks warps of a row tile summed in shared memory. grid (≤ max_tiles,
// ceil(N / (16·8/ks))), block 256.
template <int BITS, int SETS, int MT, bool G16 = false>
__device__ void mma_gsplit_t(const void* W, const aff_t* S, const aff_t* Bs, const float* x, float* y,
                             int N, int K, int G, const int* tiles, const int* n_tiles, const int* order,
                             long long xs, int x_div, int ks) {
    __shared__ int pair[MT * 8], row[MT * 8];
    const int w = threadIdx.x >> 5;
    const int n0 = (blockIdx.y * (8 / ks) + w / ks) * 16;
    const int count = n_tiles[0];
    for (int ti = blockIdx.x; ti < count; ti += gridDim.x) {
        const int e = tiles[3 * ti], f = tiles[3 * ti + 1], nb = tiles[3 * ti + 2];
        __syncthreads();
        if (threadIdx.x < MT * 8) {
            const int p = threadIdx.x < nb ? order[f + threadIdx.x] : 0;
            pair[threadIdx.x] = p;
            row[threadIdx.x] = p / x_div;
        }
        __syncthreads();
        float acc[SETS][MT][4];
        mma_rows_core<BITS, SETS, MT, G16>(W, S, Bs, x, xs, row, nb, N, K, G, (long long)e * SETS * N, n0, w % ks,
                                           ks, acc);
        reduce_warps<SETS>(acc, ks);
        if (w % ks == 0) store_frags<SETS>(acc, y, N, n0, nb, pair, 0, nullptr);
    }
}

#define MMA_GSPLIT(MT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) mma_gsplit_rows_bf16_##MT(                       \
        const bf16_t* __restrict__ W, const float* x, float* __restrict__ y, int N, int K,             \
        const int* tiles, const int* n_tiles, const int* order, long long xs, int x_div, int ks) {     \
        pdl_entry();                                                                                   \
        mma_gsplit_t<16, 1, MT>(W, nullptr, nullptr, x, y, N, K, 32, tiles, n_tiles, order, xs, x_div, ks); \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) mma_gsplit_swiglu_bf16_##MT(                     \
        const bf16_t* __restrict__ W, const float* x, float* __restrict__ h, int I, int K,             \
        const int* tiles, const int* n_tiles, const int* order, long long xs, int x_div, int ks) {     \
        pdl_entry();                                                                                   \
        mma_gsplit_t<16, 2, MT>(W, nullptr, nullptr, x, h, I, K, 32, tiles, n_tiles, order, xs, x_div, ks); \
    }                                                                                                  \
    MMA_GSPLIT_AFFINE(MT, , bits == 8, false)                                                          \
    MMA_GSPLIT_G16(MT)

// The affine grouped split-K entries (suffix TAIL): 8-bit codes where EIGHT holds, else 4-bit,
// with groups of 16 when G16.
#define MMA_GSPLIT_AFFINE(MT, TAIL, EIGHT, G16)                                                         \
    extern "C" __global__ void __launch_bounds__(256) mma_gsplit_rows_affine_##MT##TAIL(               \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,    \
        const float* x, float* __restrict__ y, int N, int K, int G, int bits,                          \
        const int* tiles, const int* n_tiles, const int* order, long long xs, int x_div, int ks) {     \
        pdl_entry();                                                                                   \
        if (EIGHT) mma_gsplit_t<8, 1, MT, G16>(W, S, B, x, y, N, K, G, tiles, n_tiles, order, xs, x_div, ks); \
        else mma_gsplit_t<4, 1, MT>(W, S, B, x, y, N, K, G, tiles, n_tiles, order, xs, x_div, ks);      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) mma_gsplit_swiglu_affine_##MT##TAIL(             \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,    \
        const float* x, float* __restrict__ h, int I, int K, int G, int bits,                          \
        const int* tiles, const int* n_tiles, const int* order, long long xs, int x_div, int ks) {     \
        pdl_entry();                                                                                   \
        if (EIGHT) mma_gsplit_t<8, 2, MT, G16>(W, S, B, x, h, I, K, G, tiles, n_tiles, order, xs, x_div, ks); \
        else mma_gsplit_t<4, 2, MT>(W, S, B, x, h, I, K, G, tiles, n_tiles, order, xs, x_div, ks);      \
    }

#if AFFINE_G16
#define MMA_GSPLIT_G16(MT) MMA_GSPLIT_AFFINE(MT, _g16, true, true)
#else
#define MMA_GSPLIT_G16(MT)
#endif

MMA_GSPLIT(1)
MMA_GSPLIT(2)

// The affine entries of the split-K, GEMM and grouped forms (suffix TAIL): 8-bit codes where EIGHT
// holds, else 4-bit, with groups of 16 when G16.
#define MMA_AFFINE(TAIL, EIGHT, G16)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) mma_rows_affine##TAIL(                            \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,     \
        const float* x, float* __restrict__ y, int N, int K, int G, int bits, int Bn, long long xs,     \
        const float* __restrict__ bias) {                                                               \
        pdl_entry();                                                                                    \
        if (EIGHT) mma_split_t<8, 1, G16>(W, S, B, x, y, N, K, G, Bn, xs, bias);                        \
        else mma_split_t<4, 1>(W, S, B, x, y, N, K, G, Bn, xs, bias);                                   \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) mma_swiglu_affine##TAIL(                          \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,     \
        const float* x, float* __restrict__ h, int I, int K, int G, int bits, int Bn, long long xs) {   \
        pdl_entry();                                                                                    \
        if (EIGHT) mma_split_t<8, 2, G16>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);                     \
        else mma_split_t<4, 2>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);                                \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) mma_gemm_rows_affine##TAIL(                       \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,     \
        const float* x, float* __restrict__ y, int N, int K, int G, int bits, int Bn, long long xs,     \
        const float* __restrict__ bias) {                                                               \
        pdl_entry();                                                                                    \
        if (EIGHT) mma_gemm_t<8, 1, G16>(W, S, B, x, y, N, K, G, Bn, xs, bias);                         \
        else mma_gemm_t<4, 1>(W, S, B, x, y, N, K, G, Bn, xs, bias);                                    \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) mma_gemm_swiglu_affine##TAIL(                     \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,     \
        const float* x, float* __restrict__ h, int I, int K, int G, int bits, int Bn, long long xs) {   \
        pdl_entry();                                                                                    \
        if (EIGHT) mma_gemm_t<8, 2, G16>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);                      \
        else mma_gemm_t<4, 2>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);                                 \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) mma_grouped_rows_affine##TAIL(                    \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,     \
        const float* x, float* __restrict__ y, int N, int K, int G, int bits, const int* tiles,         \
        const int* n_tiles, const int* order, long long xs, int x_div) {                                \
        pdl_entry();                                                                                    \
        if (EIGHT) mma_grouped_t<8, 1, G16>(W, S, B, x, y, N, K, G, tiles, n_tiles, order, xs, x_div);  \
        else mma_grouped_t<4, 1>(W, S, B, x, y, N, K, G, tiles, n_tiles, order, xs, x_div);             \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) mma_grouped_swiglu_affine##TAIL(                  \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,     \
        const float* x, float* __restrict__ h, int I, int K, int G, int bits, const int* tiles,         \
        const int* n_tiles, const int* order, long long xs, int x_div) {                                \
        pdl_entry();                                                                                    \
        if (EIGHT) mma_grouped_t<8, 2, G16>(W, S, B, x, h, I, K, G, tiles, n_tiles, order, xs, x_div);  \
        else mma_grouped_t<4, 2>(W, S, B, x, h, I, K, G, tiles, n_tiles, order, xs, x_div);             \
    }

MMA_AFFINE(, bits == 8, false)

#if AFFINE_G16
// The entries for 8-bit codes in groups of 16 (mma_frag.cuh), with the same arguments (bits 8,
// G 16).
MMA_AFFINE(_g16, true, true)
#endif
