// One matrix times a batch of B input rows on tensor cores (batched decode, prefill
// projections), at about f32 accuracy: y[b, n] = Σ_k W[n, k] x[b, k] (+ bias[n]).
//
// mma.sync m16n8k16 (bf16 in, f32 accumulate) with A = 16 weight rows, B = 8 input rows. The
// weights enter exactly: bf16 matrices as they are, MLX affine 4/8-bit ones as their integer
// codes q (exact in bf16), with the FMA dequant form applied per group of G inputs:
// Σ_k w x = scale·Σ_k q x + bias·Σ_k x. Each input x is split into x_hi = bf16(x) and
// x_lo = bf16(x − x_hi), two products per tile, so the inputs keep ~16 significant bits.
//
// Layouts: W bf16 [N, K], or affine words u32 [N, K·bits/32] (LSB first) with scales and biases
// bf16 [N, K/G], G ∈ {32, 64, 128}; x: row b at x + b·x_stride (16-byte aligned); y: [B, N];
// K % 32 == 0. SwiGLU form: W = [gate (I rows) | up (I rows)], h[b, n] = silu(G_n·x_b)·U_n·x_b,
// h: [B, I].
//
// GEMM form (many inputs: prefill, large batches; mma_gemm_*): grid (ceil(B / 32),
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
// grid (ceil(B / 32), ceil(N / 16)) (N = I for SwiGLU), block 256: a block takes weight rows
// blockIdx.y·16 + 0..16 and input rows blockIdx.x·32 + 0..32 (four 8-row tiles); its 8 warps
// split K (warp w takes the 32-wide chunks c ≡ w mod 8) and are summed in shared memory. Per
// chunk, k = 32c + 8t + 0..7 (t = lane % 4): lane l holds the 8 values of weight rows l/4 and
// l/4 + 8 and of input row l/4 of each tile; the mma's k slots 2t, 2t+1, 2t+8, 2t+9 of its two
// k16 steps are mapped to these k (any consistent mapping gives the same sum). Groups hold
// whole chunks, so the dequant form is applied after every chunk.

#define MMA_TILES 4

// Codes q0, q1 < 256 as bf16x2 (exact: 8 significant bits).
__device__ __forceinline__ unsigned codes_bf16(unsigned q0, unsigned q1, int bits) {
    return bits == 4 ? codes4_bf16(q0, q1) : pack_bf16((float)q0, (float)q1);
}

// The 8 values (as 4 bf16x2 pairs) of weight row `row` at k = k0..k0+8, and for affine rows
// the (scale, bias) of their group.
template <int BITS>
__device__ __forceinline__ void load_w(const void* __restrict__ W, const bf16_t* __restrict__ S,
                                       const bf16_t* __restrict__ Bs, long long row, int K, int k0,
                                       int gshift, unsigned p[4], float* sc, float* bi) {
    if (BITS == 16) {
        uint4 v = __ldcs(reinterpret_cast<const uint4*>(reinterpret_cast<const bf16_t*>(W) + row * K + k0));
        p[0] = v.x; p[1] = v.y; p[2] = v.z; p[3] = v.w;
    } else {
        const unsigned* w = reinterpret_cast<const unsigned*>(W) + row * (K * BITS / 32) + k0 * BITS / 32;
        const unsigned mask = (1u << BITS) - 1u;
        unsigned lo = __ldcs(w), hi = BITS == 8 ? __ldcs(w + 1) : lo >> 16;
        if (BITS == 4) lo &= 0xffffu;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            unsigned part = i == 0 ? lo : hi;
            const int sh = BITS;
            p[2 * i] = codes_bf16(part & mask, (part >> sh) & mask, BITS);
            p[2 * i + 1] = codes_bf16((part >> (2 * sh)) & mask, (part >> (3 * sh)) & mask, BITS);
        }
        long long g = row * (K >> gshift) + (k0 >> gshift);
        *sc = bf16f(S[g]);
        *bi = bf16f(Bs[g]);
    }
}

// Zeroes a warp's accumulators and per-group partial sums.
template <int SETS>
__device__ __forceinline__ void zero_frags(float acc[SETS][MMA_TILES][4], float part[SETS][MMA_TILES][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[s][j][e] = part[s][j][e] = 0.f;
}

// The A fragments of rows r0 and r1 of every set (set s at s·set_off) at k0, with the
// (scale, bias) of their group for affine weights.
template <int BITS, int SETS>
__device__ __forceinline__ void load_sets(const void* __restrict__ W, const bf16_t* __restrict__ S,
                                          const bf16_t* __restrict__ Bs, long long r0, long long r1,
                                          long long set_off, int K, int k0, int gshift, unsigned a[SETS][2][4],
                                          float sc[SETS][2], float bi[SETS][2]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        load_w<BITS>(W, S, Bs, s * set_off + r0, K, k0, gshift, a[s][0], &sc[s][0], &bi[s][0]);
        load_w<BITS>(W, S, Bs, s * set_off + r1, K, k0, gshift, a[s][1], &sc[s][1], &bi[s][1]);
    }
}

// Input tile j (its bf16 hi and lo pairs) through both k16 steps of every set: into acc for bf16
// weights, into the group partials for affine codes. Step 0 takes values 0..3, step 1 values
// 4..7 (pairs a[..][2·st], a[..][2·st + 1]).
template <int BITS, int SETS>
__device__ __forceinline__ void mma_sets(const unsigned a[SETS][2][4], const unsigned hi[4], const unsigned lo[4],
                                         int j, float acc[SETS][MMA_TILES][4], float part[SETS][MMA_TILES][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        float* d = BITS == 16 ? acc[s][j] : part[s][j];
#pragma unroll
        for (int st = 0; st < 2; ++st) {
            unsigned a0 = a[s][0][2 * st], a1 = a[s][1][2 * st];
            unsigned a2 = a[s][0][2 * st + 1], a3 = a[s][1][2 * st + 1];
            mma_bf16(d, a0, a1, a2, a3, hi[2 * st], hi[2 * st + 1]);
            mma_bf16(d, a0, a1, a2, a3, lo[2 * st], lo[2 * st + 1]);
        }
    }
}

// The FMA dequant form for tile j: acc += scale·Σ q x + bias·Σ x for each (row, input) of the
// fragment (x0, x1: the sums of its inputs 2t and 2t + 1), then the partials restart.
template <int SETS>
__device__ __forceinline__ void flush_tile(const float sc[SETS][2], const float bi[SETS][2], float x0, float x1,
                                           int j, float acc[SETS][MMA_TILES][4], float part[SETS][MMA_TILES][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        float* A = acc[s][j];
        float* P = part[s][j];
        A[0] = fmaf(sc[s][0], P[0], fmaf(bi[s][0], x0, A[0]));
        A[1] = fmaf(sc[s][0], P[1], fmaf(bi[s][0], x1, A[1]));
        A[2] = fmaf(sc[s][1], P[2], fmaf(bi[s][1], x0, A[2]));
        A[3] = fmaf(sc[s][1], P[3], fmaf(bi[s][1], x1, A[3]));
        P[0] = P[1] = P[2] = P[3] = 0.f;
    }
}

// Accumulates, for one warp, rows n0..n0+16 (and, with `SW`, rows I + n0.. as the second
// output set) against input rows b0..b0+32 into acc[set][tile][4] (mma C layout: rows l/4,
// l/4 + 8, inputs 2(l%4), 2(l%4)+1 of the tile).
// Input row b of the warp's 32 is at x + b·xs.
template <int BITS, int SETS>
__device__ void mma_rows_core(const void* __restrict__ W, const bf16_t* __restrict__ S,
                              const bf16_t* __restrict__ Bs, const float* x, long long xs,
                              int nb, int N, int K, int G, long long set_off, int n0,
                              float acc[SETS][MMA_TILES][4]) {
    int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
    int gshift = __ffs(G) - 1;
    long long r0 = min(n0 + gid, N - 1), r1 = min(n0 + gid + 8, N - 1);
    float part[SETS][MMA_TILES][4];
    zero_frags<SETS>(acc, part);
    float xsum[MMA_TILES];
#pragma unroll
    for (int j = 0; j < MMA_TILES; ++j) xsum[j] = 0.f;
    for (int c = (threadIdx.x >> 5) * 32; c < K; c += 256) {
        int k0 = c + 8 * t;
        unsigned a[SETS][2][4];
        float sc[SETS][2], bi[SETS][2];
        load_sets<BITS, SETS>(W, S, Bs, r0, r1, set_off, K, k0, gshift, a, sc, bi);
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j) {
            if (j * 8 >= nb) break;
            int b = j * 8 + gid;
            float xv[8];
            if (b < nb) {
                const float* xr = x + b * xs + k0;
                float4 f0 = *reinterpret_cast<const float4*>(xr);
                float4 f1 = *reinterpret_cast<const float4*>(xr + 4);
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
            if (BITS != 16)
#pragma unroll
                for (int i = 0; i < 8; ++i) xsum[j] += xv[i];
            mma_sets<BITS, SETS>(a, hi, lo, j, acc, part);
        }
        if (BITS != 16) {
            // Each lane summed its 8 inputs of row gid; the quad holds the row's chunk sum.
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j) {
                if (j * 8 >= nb) break;
                float xt = xsum[j];
                xt += __shfl_xor_sync(0xffffffffu, xt, 1);
                xt += __shfl_xor_sync(0xffffffffu, xt, 2);
                float x0 = __shfl_sync(0xffffffffu, xt, (2 * t) * 4);
                float x1 = __shfl_sync(0xffffffffu, xt, (2 * t + 1) * 4);
                flush_tile<SETS>(sc, bi, x0, x1, j, acc, part);
                xsum[j] = 0.f;
            }
        }
    }
}

// Sums the 8 warps' fragments into warp 0's (through shared memory).
template <int SETS>
__device__ void reduce_warps(float acc[SETS][MMA_TILES][4]) {
    __shared__ float red[7][SETS * MMA_TILES * 4][32];
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (w > 0)
#pragma unroll
        for (int s = 0; s < SETS; ++s)
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[w - 1][(s * MMA_TILES + j) * 4 + e][lane] = acc[s][j][e];
    __syncthreads();
    if (w == 0)
        for (int o = 0; o < 7; ++o)
#pragma unroll
            for (int s = 0; s < SETS; ++s)
#pragma unroll
                for (int j = 0; j < MMA_TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[s][j][e] += red[o][(s * MMA_TILES + j) * 4 + e][lane];
}

// Writes a warp's fragments: output row n (< N) of input b (< nb) goes to y[out_row(b)·N + n];
// with SETS 2 the value is silu(set 0)·set 1.
template <int SETS>
__device__ __forceinline__ void store_frags(float acc[SETS][MMA_TILES][4], float* y, int N, int r, int nb,
                                            const int* out_rows, int b0, const float* bias) {
    int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < MMA_TILES; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int n = r + gid + (e >= 2 ? 8 : 0), b = j * 8 + 2 * t + (e & 1);
            if (n < N && b < nb) {
                float v = SETS == 2 ? silu_f(acc[0][j][e]) * acc[SETS - 1][j][e] : acc[0][j][e];
                long long o = out_rows ? out_rows[b] : b0 + b;
                y[o * N + n] = v + (bias ? bias[n] : 0.f);
            }
        }
}

// The split-K form: the block's 8 warps split K for one 16-row tile, then warp 0 stores.
template <int BITS, int SETS>
__device__ void mma_split_t(const void* W, const bf16_t* S, const bf16_t* Bs, const float* x, float* y,
                            int N, int K, int G, int Bn, long long xs, const float* bias) {
    int n0 = blockIdx.y * 16;
    int b0 = blockIdx.x * 8 * MMA_TILES;
    float acc[SETS][MMA_TILES][4];
    mma_rows_core<BITS, SETS>(W, S, Bs, x + b0 * xs, xs, Bn - b0, N, K, G, N, n0, acc);
    reduce_warps<SETS>(acc);
    if (threadIdx.x >= 32) return;
    store_frags<SETS>(acc, y, N, n0, Bn - b0, nullptr, b0, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                float* __restrict__ y, int N, int K, int Bn, long long xs,
                                                                const float* __restrict__ bias) {
    pdl_entry();
    mma_split_t<16, 1>(W, nullptr, nullptr, x, y, N, K, 32, Bn, xs, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_rows_affine(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                                                                  const bf16_t* __restrict__ B, const float* x,
                                                                  float* __restrict__ y, int N, int K, int G, int bits, int Bn,
                                                                  long long xs, const float* __restrict__ bias) {
    pdl_entry();
    if (bits == 8) mma_split_t<8, 1>(W, S, B, x, y, N, K, G, Bn, xs, bias);
    else mma_split_t<4, 1>(W, S, B, x, y, N, K, G, Bn, xs, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_swiglu_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                  float* __restrict__ h, int I, int K, int Bn, long long xs) {
    pdl_entry();
    mma_split_t<16, 2>(W, nullptr, nullptr, x, h, I, K, 32, Bn, xs, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) mma_swiglu_affine(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                                                                    const bf16_t* __restrict__ B, const float* x,
                                                                    float* __restrict__ h, int I, int K, int G, int bits, int Bn,
                                                                    long long xs) {
    pdl_entry();
    if (bits == 8) mma_split_t<8, 2>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);
    else mma_split_t<4, 2>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);
}

// Row stride (bf16) of the staged input tile: 32 values + 8 of padding against bank conflicts.
#define XS_PAD 40

// The GEMM form's accumulation for one warp: weight rows base + s·set_off + min(r + 0..16,
// N − 1) of each set s against the block's nb ≤ 32 inputs (row b at x + b·xs, or x +
// rows[b]·xs), staged per chunk in shared memory by all 256 threads. acc as mma_rows_core.
template <int BITS, int SETS>
__device__ void mma_gemm_core(const void* __restrict__ W, const bf16_t* __restrict__ S,
                              const bf16_t* __restrict__ Bs, const float* x, long long xs,
                              const int* rows, int nb, int N, int K, int G, long long set_off,
                              long long base, int r, float acc[SETS][MMA_TILES][4]) {
    __shared__ __align__(16) bf16_t xh[32 * XS_PAD], xl[32 * XS_PAD];
    __shared__ float xsum[32];
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
        unsigned h0 = pack_bf16(f.x, f.y), h1 = pack_bf16(f.z, f.w);
        unsigned l0 = pack_bf16(f.x - bf16lo(h0), f.y - bf16hi(h0));
        unsigned l1 = pack_bf16(f.z - bf16lo(h1), f.w - bf16hi(h1));
        *reinterpret_cast<uint2*>(&xh[sb * XS_PAD + 4 * sq]) = make_uint2(h0, h1);
        *reinterpret_cast<uint2*>(&xl[sb * XS_PAD + 4 * sq]) = make_uint2(l0, l1);
        if (BITS != 16) {
            float su = (f.x + f.y) + (f.z + f.w);
            su += __shfl_xor_sync(0xffffffffu, su, 1);
            su += __shfl_xor_sync(0xffffffffu, su, 2);
            su += __shfl_xor_sync(0xffffffffu, su, 4);
            if (sq == 0) xsum[sb] = su;
        }
        __syncthreads();
        int k0 = c + 8 * t;
        unsigned a[SETS][2][4];
        float sc[SETS][2], bi[SETS][2];
        load_sets<BITS, SETS>(W, S, Bs, r0, r1, set_off, K, k0, gshift, a, sc, bi);
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j) {
            if (j * 8 >= nb) break;
            int b = j * 8 + gid;
            uint4 hv = *reinterpret_cast<const uint4*>(&xh[b * XS_PAD + 8 * t]);
            uint4 lv = *reinterpret_cast<const uint4*>(&xl[b * XS_PAD + 8 * t]);
            unsigned hi[4] = {hv.x, hv.y, hv.z, hv.w}, lo[4] = {lv.x, lv.y, lv.z, lv.w};
            mma_sets<BITS, SETS>(a, hi, lo, j, acc, part);
        }
        if (BITS != 16) {
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j) {
                if (j * 8 >= nb) break;
                float x0 = xsum[j * 8 + 2 * t], x1 = xsum[j * 8 + 2 * t + 1];
                flush_tile<SETS>(sc, bi, x0, x1, j, acc, part);
            }
        }
    }
}

template <int BITS, int SETS>
__device__ void mma_gemm_t(const void* W, const bf16_t* S, const bf16_t* Bs, const float* x, float* y,
                           int N, int K, int G, int Bn, long long xs, const float* bias) {
    int r = blockIdx.y * 128 + (threadIdx.x >> 5) * 16;
    int b0 = blockIdx.x * 8 * MMA_TILES;
    float acc[SETS][MMA_TILES][4];
    mma_gemm_core<BITS, SETS>(W, S, Bs, x + b0 * xs, xs, nullptr, Bn - b0, N, K, G, N, 0, r, acc);
    store_frags<SETS>(acc, y, N, r, Bn - b0, nullptr, b0, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_gemm_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                     float* __restrict__ y, int N, int K, int Bn, long long xs,
                                                                     const float* __restrict__ bias) {
    pdl_entry();
    mma_gemm_t<16, 1>(W, nullptr, nullptr, x, y, N, K, 32, Bn, xs, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_gemm_rows_affine(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                                                                       const bf16_t* __restrict__ B, const float* x,
                                                                       float* __restrict__ y, int N, int K, int G, int bits, int Bn,
                                                                       long long xs, const float* __restrict__ bias) {
    pdl_entry();
    if (bits == 8) mma_gemm_t<8, 1>(W, S, B, x, y, N, K, G, Bn, xs, bias);
    else mma_gemm_t<4, 1>(W, S, B, x, y, N, K, G, Bn, xs, bias);
}

extern "C" __global__ void __launch_bounds__(256) mma_gemm_swiglu_bf16(const bf16_t* __restrict__ W, const float* x,
                                                                       float* __restrict__ h, int I, int K, int Bn, long long xs) {
    pdl_entry();
    mma_gemm_t<16, 2>(W, nullptr, nullptr, x, h, I, K, 32, Bn, xs, nullptr);
}

extern "C" __global__ void __launch_bounds__(256) mma_gemm_swiglu_affine(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                                                                         const bf16_t* __restrict__ B, const float* x,
                                                                         float* __restrict__ h, int I, int K, int G, int bits, int Bn,
                                                                         long long xs) {
    pdl_entry();
    if (bits == 8) mma_gemm_t<8, 2>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);
    else mma_gemm_t<4, 2>(W, S, B, x, h, I, K, G, Bn, xs, nullptr);
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

template <int BITS, int SETS>
__device__ void mma_grouped_t(const void* W, const bf16_t* S, const bf16_t* Bs, const float* x, float* y,
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
    mma_gemm_core<BITS, SETS>(W, S, Bs, x, xs, row, nb, N, K, G, N, base, r, acc);
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

extern "C" __global__ void __launch_bounds__(256) mma_grouped_rows_affine(
    const unsigned* __restrict__ W, const bf16_t* __restrict__ S, const bf16_t* __restrict__ B,
    const float* x, float* __restrict__ y, int N, int K, int G, int bits,
    const int* tiles, const int* n_tiles, const int* order,
    long long xs, int x_div) {
    pdl_entry();
    if (bits == 8) mma_grouped_t<8, 1>(W, S, B, x, y, N, K, G, tiles, n_tiles, order, xs, x_div);
    else mma_grouped_t<4, 1>(W, S, B, x, y, N, K, G, tiles, n_tiles, order, xs, x_div);
}

extern "C" __global__ void __launch_bounds__(256) mma_grouped_swiglu_affine(
    const unsigned* __restrict__ W, const bf16_t* __restrict__ S, const bf16_t* __restrict__ B,
    const float* x, float* __restrict__ h, int I, int K, int G, int bits,
    const int* tiles, const int* n_tiles, const int* order,
    long long xs, int x_div) {
    pdl_entry();
    if (bits == 8) mma_grouped_t<8, 2>(W, S, B, x, h, I, K, G, tiles, n_tiles, order, xs, x_div);
    else mma_grouped_t<4, 2>(W, S, B, x, h, I, K, G, tiles, n_tiles, order, xs, x_div);
}
