// Tensor-core fragments of the batched products (mma_rows.cu, mma_wide.cu; prefixed to both):
// y[b, n] = Σ_k W[n, k] x[b, k] (+ bias[n]) at about f32 accuracy.
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
// Per 32-wide K chunk c, k = 32c + 8t + 0..7 (t = lane % 4): lane l holds the 8 values of weight
// rows l/4 and l/4 + 8 and of input row l/4 of each 8-row tile; the mma's k slots 2t, 2t+1,
// 2t+8, 2t+9 of its two k16 steps are mapped to these k (any consistent mapping gives the same
// sum). Groups hold whole chunks.

#define MMA_TILES 4

// Codes q0, q1 < 256 as bf16x2 (exact: 8 significant bits).
__device__ __forceinline__ unsigned codes_bf16(unsigned q0, unsigned q1, int bits) {
    return bits == 4 ? codes4_bf16(q0, q1) : pack_bf16((float)q0, (float)q1);
}

// The raw data of 8 values of one weight row: bf16 values (four words), or affine words (one at
// 4 bits, two at 8) with the bf16 scale and bias of their group.
template <int BITS>
struct WRaw {
    unsigned v[BITS == 16 ? 4 : BITS / 4];
    unsigned sb;
};

// Loads weight row `row` at k = k0..k0+8 (see WRaw).
template <int BITS>
__device__ __forceinline__ void fetch_w(const void* __restrict__ W, const bf16_t* __restrict__ S,
                                        const bf16_t* __restrict__ Bs, long long row, int K, int k0,
                                        int gshift, WRaw<BITS>& r) {
    if constexpr (BITS == 16) {
        uint4 v = __ldcs(reinterpret_cast<const uint4*>(reinterpret_cast<const bf16_t*>(W) + row * K + k0));
        r.v[0] = v.x; r.v[1] = v.y; r.v[2] = v.z; r.v[3] = v.w;
    } else {
        const unsigned* w = reinterpret_cast<const unsigned*>(W) + row * (K * BITS / 32) + k0 * BITS / 32;
        r.v[0] = __ldcs(w);
        if constexpr (BITS == 8) r.v[1] = __ldcs(w + 1);
        long long g = row * (K >> gshift) + (k0 >> gshift);
        r.sb = (unsigned)S[g] | ((unsigned)Bs[g] << 16);
    }
}

// The 8 values of `r` as 4 bf16x2 pairs (affine: the integer codes), and for affine rows the
// (scale, bias) of their group.
template <int BITS>
__device__ __forceinline__ void decode_w(const WRaw<BITS>& r, unsigned p[4], float* sc, float* bi) {
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
        *sc = bf16f((bf16_t)(r.sb & 0xffffu));
        *bi = bf16f((bf16_t)(r.sb >> 16));
    }
}

// Zeroes a warp's fragments and group partials.
template <int SETS, int MT>
__device__ __forceinline__ void zero_frags(float acc[SETS][MT][4], float part[SETS][MT][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[s][j][e] = part[s][j][e] = 0.f;
}

// The raw data of rows r0 and r1 of every set (set s at s·set_off) at k0 (see WRaw).
template <int BITS, int SETS>
__device__ __forceinline__ void fetch_sets(const void* __restrict__ W, const bf16_t* __restrict__ S,
                                           const bf16_t* __restrict__ Bs, long long r0, long long r1,
                                           long long set_off, int K, int k0, int gshift, WRaw<BITS> r[SETS][2]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        fetch_w<BITS>(W, S, Bs, s * set_off + r0, K, k0, gshift, r[s][0]);
        fetch_w<BITS>(W, S, Bs, s * set_off + r1, K, k0, gshift, r[s][1]);
    }
}

// The A fragments of fetched rows `r`, with the (scale, bias) of their group for affine weights.
template <int BITS, int SETS>
__device__ __forceinline__ void decode_sets(const WRaw<BITS> r[SETS][2], unsigned a[SETS][2][4], float sc[SETS][2],
                                            float bi[SETS][2]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        decode_w<BITS>(r[s][0], a[s][0], &sc[s][0], &bi[s][0]);
        decode_w<BITS>(r[s][1], a[s][1], &sc[s][1], &bi[s][1]);
    }
}

// The A fragments of rows r0 and r1 of every set (set s at s·set_off) at k0, with the
// (scale, bias) of their group for affine weights.
template <int BITS, int SETS>
__device__ __forceinline__ void load_sets(const void* __restrict__ W, const bf16_t* __restrict__ S,
                                          const bf16_t* __restrict__ Bs, long long r0, long long r1,
                                          long long set_off, int K, int k0, int gshift, unsigned a[SETS][2][4],
                                          float sc[SETS][2], float bi[SETS][2]) {
    WRaw<BITS> r[SETS][2];
    fetch_sets<BITS, SETS>(W, S, Bs, r0, r1, set_off, K, k0, gshift, r);
    decode_sets<BITS, SETS>(r, a, sc, bi);
}

// Input tile j (its bf16 hi and lo pairs) through both k16 steps of every set: into acc for bf16
// weights, into the group partials for affine codes. Step 0 takes values 0..3, step 1 values
// 4..7 (pairs a[..][2·st], a[..][2·st + 1]).
template <int BITS, int SETS, int MT>
__device__ __forceinline__ void mma_sets(const unsigned a[SETS][2][4], const unsigned hi[4], const unsigned lo[4],
                                         int j, float acc[SETS][MT][4], float part[SETS][MT][4]) {
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
template <int SETS, int MT>
__device__ __forceinline__ void flush_tile(const float sc[SETS][2], const float bi[SETS][2], float x0, float x1,
                                           int j, float acc[SETS][MT][4], float part[SETS][MT][4]) {
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

// Stages four inputs `f` of a chunk for every warp of the block: as bf16 hi and lo pairs at
// hi[4·sq], lo[4·sq] of their input row, and, for affine weights, the row's chunk sum (the 8
// threads sq = 0..7 of a row are adjacent lanes) into *sum by thread sq = 0.
template <int BITS>
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
        su += __shfl_xor_sync(0xffffffffu, su, 4);
        if (sq == 0) *sum = su;
    }
}

// One chunk's products for a warp against the staged inputs (input b's hi and lo at xh, xl +
// b·ld, its chunk sum at xsum[b]; nb inputs): every tile's mma pairs into acc (bf16 weights) or
// the partials, then, for affine weights, the dequant form with the chunk's (scale, bias).
template <int BITS, int SETS>
__device__ __forceinline__ void mma_staged(const unsigned a[SETS][2][4], const float sc[SETS][2],
                                           const float bi[SETS][2], const bf16_t* xh, const bf16_t* xl,
                                           int ld, const float* xsum, int nb,
                                           float acc[SETS][MMA_TILES][4], float part[SETS][MMA_TILES][4]) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
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
            flush_tile<SETS>(sc, bi, xsum[j * 8 + 2 * t], xsum[j * 8 + 2 * t + 1], j, acc, part);
        }
    }
}

// Writes a warp's fragments: output row n (< N) of input b (< nb) goes to y[out_row(b)·N + n];
// with SETS 2 the value is silu(set 0)·set 1.
template <int SETS, int MT>
__device__ __forceinline__ void store_frags(float acc[SETS][MT][4], float* y, int N, int r, int nb,
                                            const int* out_rows, int b0, const float* bias) {
    int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < MT; ++j)
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

