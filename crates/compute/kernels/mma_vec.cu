// One input row through a 4-bit MLX affine matrix on tensor cores (decode projections, lm_head):
// y[n] = Σ_k W[n, k] x[k] (+ bias[n]), at about f32 accuracy. Dequantizing on CUDA cores costs
// several instructions per weight, more than the issue rate allows at memory speed; here two
// codes cost a shift and a lop3, and the products run as mma.sync.
//
// Numerics: the weights enter exactly as 128 + q (bf16, the code under a fixed exponent), x is
// split into x_hi = bf16(x) and x_lo = bf16(x − x_hi) (columns 0 and 1 of one product, ~16
// significant bits), and per group of G the FMA dequant form is applied with the offset taken off:
// Σ_k w x = scale·(Σ_k (128 + q) x' − 128·Σ_k x') + bias·Σ_k x, x' = x_hi + x_lo (the group's
// sum of x' in f32, as the products see it).
//
// Layouts: words u32 [N, K/8] (LSB first), scales and biases bf16 [N, K/G], G ∈ {32, 64, 128},
// K % G == 0; x f32 [K] (16-byte aligned); y f32 [N]; bias f32 [N] or null.
//
// The first blocks ask L2 for their rows of W, S and B before waiting on the kernel before it
// (common.cuh, PREFETCH_BLOCKS), every warp loads the words of its first groups before that wait
// too (weights never depend on an earlier kernel), and every block asks L1 for its rows' scales
// and biases, read once per group after the products.
//
// grid ceil(N / (16·T)), block 256, dynamic shared memory K·5 + (K/G)·8 bytes; T = `tiles`
// (1 to 4) row tiles of 16 per block. The block stages x once for its 16·T rows: per word
// position w (k = 8w..8w+7) the bf16x2 pairs (x0,x4), (x1,x5), (x2,x6), (x3,x7) of x_hi then of
// x_lo, the word's sums of x and of x_hi + x_lo, and the same sums over each group. Warp v takes
// the groups g ≡ v (mod 8), U = clamp(12/(T·P), 1, 4) at a time with all their loads in flight
// (2·T·P words per group and lane, at most 24; two blocks per SM: launch bounds cap the
// registers at 128). Within a group, lane (gid, t) of the mma holds rows gid and gid + 8 of each
// tile and the group's words t·P .. t·P + P (P = G/32, one 4-, 8- or 16-byte load per row): word
// j of every lane forms one 32-wide k chunk, two k16 steps whose k slots {2t, 2t+1} and
// {2t+8, 2t+9} take nibbles (i, i+4) and (i+1, i+5) of the lane's word, and x the same pairs (any
// consistent mapping of k gives the same sum). Input columns 0 and 1 are x_hi and x_lo (B is
// zero in lanes with gid ≥ 2), so one mma per k16 step takes both: half the products of two
// mmas with column 0 alone, which bound the kernel when its weights are already on chip. After
// each group, lanes t = 0 (which hold columns 0 and 1) fold the group's two partial sums in
// with its scale and bias; the 8 warps' sums meet in shared memory.
//
// VecIo (one per launch, by value) adds to either entry, for a decode layer's fused steps:
// - norm: x is a raw residual row to be taken through an RMSNorm first: the block stages
//   x·norm and takes Σ x² on the way, and scales its outputs by r = 1/sqrt(mean(x²) + eps)
//   (W (x·r·norm) = r·W (x·norm), so the sum is met only after the products); block 0 then
//   writes x·r·norm to `normed` when given. The norms before a layer's mixer and its ffn.
// - accumulate: y[n] += W x (+ bias) instead of y[n] = …: the residual add after a projection.
// - conv (conv_c > 0): rows n < conv_c are also the GDN conv1d inputs of channel n, by gdn.cu's
//   gdn_conv_step's code (common.cuh's conv_load/conv_advance): mixed[n] = silu(Σ_j conv_w[n, j]
//   ·st[j, n] + conv_w[n, Kc−1]·y[n]) with st = conv_state + slots[0]·(Kc−1)·conv_c, which then
//   shifts by one and takes y[n]. Each row belongs to one block, so the state update has one writer.
//
// mma_vec_affine4_staged, for a launch of one wave: each block instead copies its rows of W, S
// and B into shared memory (after the staged x, rounded to 16 bytes: 16·T rows of K/2 + 32
// bytes, then 16·T·(K/G)·4 bytes of scales and biases, then an 8-byte barrier) with bulk copies
// issued before its wait, and the same loop reads the words from there.

struct VecIo {
    const float* norm;
    float* normed;
    float eps;
    int accumulate;
    const int* slots;
    float* conv_state;
    const float* conv_w;
    float* mixed;
    int conv_c, conv_k;
};

// Nibbles i and i + 4 of w as exact bf16x2 (128 + q_i, 128 + q_{i+4}): (q | 0x4300) is 128 + q
// in bf16. A shift and one three-input lop3, (a & b) | c; the offset of 128 leaves the products
// and is taken off each group's sum (128 · Σ x over the group, as the products see x).
__device__ __forceinline__ unsigned nib_pair(unsigned w, int i) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
    return r;
}

// Bytes of the staged input (x_hi/x_lo pairs, word and group sums) rounded to 16: the staged
// weight tile follows it.
__device__ __forceinline__ int vec_stage_bytes(int K, int ng) {
    return (K * 5 + ng * 8 + 15) & ~15;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// The bulk copies and their barrier exist from sm_90 on; before, these helpers are empty and the
// host never launches the staged entry (cuda/vec.rs).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VEC_BULK 1
#else
#define VEC_BULK 0
#endif

// An mbarrier expecting one arrival (bulk copies complete their bytes on it).
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
#if VEC_BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// The one arrival, with the bytes the copies will bring.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
#if VEC_BULK
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}

// Copy `bytes` (a multiple of 16; both ends 16-byte aligned) from global to shared memory,
// completing on `bar`.
__device__ __forceinline__ void bulk_to_smem(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
#if VEC_BULK
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_u32(bar)) : "memory");
#endif
}

// Wait until the barrier's phase `parity` completed (all its bytes arrived).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if VEC_BULK
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
}

// P consecutive words of a row at word offset `at` (16-byte aligned for P = 4, 8-byte for 2):
// streamed from global memory, or (SM) read from the block's staged tile in shared memory.
template <bool SM, typename V>
__device__ __forceinline__ V load_word(const V* p) {
    return SM ? *p : __ldcs(p);
}

template <int P, bool SM>
__device__ __forceinline__ void load_words(const unsigned* __restrict__ row, long long at, unsigned out[P]) {
    if (P == 4) {
        uint4 v = load_word<SM>(reinterpret_cast<const uint4*>(row + at));
        out[0] = v.x; out[1] = v.y; out[2 % P] = v.z; out[3 % P] = v.w;
    } else if (P == 2) {
        uint2 v = load_word<SM>(reinterpret_cast<const uint2*>(row + at));
        out[0] = v.x; out[1 % P] = v.y;
    } else {
        out[0] = load_word<SM>(row + at);
    }
}

// Words between the starts of two rows of a staged tile: 32 bytes of padding put the 8 rows a
// warp's lanes read at once (gid = 0..7) on different banks.
#define VEC_ROW_PAD 8

// SM: the block's rows of W, S and B were staged in shared memory (mma_vec_affine4_staged).
template <int P, int T, bool SM>
__device__ void mma_vec_t(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                          const bf16_t* __restrict__ Bs, const float* __restrict__ x, float* __restrict__ y,
                          int N, int K, const float* __restrict__ bias, const VecIo& io,
                          float (*red)[64]) {
    // Groups in flight per warp iteration: 2·T·P·U ≤ 24 words per lane (at most 4 groups).
    constexpr int U_FIT = 12 / (T * P);
    constexpr int U = U_FIT < 1 ? 1 : U_FIT > 4 ? 4 : U_FIT;
    extern __shared__ __align__(16) unsigned char vec_smem[];
    const int G = 32 * P, nw = K / 8, ng = K / G;
    uint4* xs = reinterpret_cast<uint4*>(vec_smem);                    // [nw][2]: hi, lo pairs
    float* ws = reinterpret_cast<float*>(vec_smem + (size_t)nw * 32);  // [nw] word sums of x
    float* wh = ws + nw;                                               // [nw] of hi + lo
    float* gs = wh + nw;                                               // [ng] group sums of x
    float* gh = gs + ng;                                               // [ng] of hi + lo
    const int tid = threadIdx.x, v = tid >> 5, lane = tid & 31, gid = lane >> 2, t = lane & 3;

    const int n0 = blockIdx.x * 16 * T;
    // Staged tile (SM): 16·T rows of words, nw + VEC_ROW_PAD apart, then the rows' scales and
    // biases [16·T, ng] each, then the barrier the copies complete on.
    const int rs = nw + VEC_ROW_PAD;
    unsigned* tw = reinterpret_cast<unsigned*>(vec_smem + vec_stage_bytes(K, ng));
    bf16_t* ts = reinterpret_cast<bf16_t*>(tw + 16 * T * rs);
    bf16_t* tb = ts + 16 * T * ng;
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(tb + 16 * T * ng);
    long long r0[T], r1[T];
#pragma unroll
    for (int i = 0; i < T; ++i) {
        r0[i] = min(n0 + 16 * i + gid, N - 1);
        r1[i] = min(n0 + 16 * i + gid + 8, N - 1);
    }
    // Where rows r0, r1 are read: the global matrix, or the tile (row − n0).
    const unsigned* w0[T];
    const unsigned* w1[T];
#pragma unroll
    for (int i = 0; i < T; ++i) {
        w0[i] = SM ? tw + (r0[i] - n0) * rs : W + r0[i] * nw;
        w1[i] = SM ? tw + (r1[i] - n0) * rs : W + r1[i] * nw;
    }
    // Words of the warp's first U groups: weights do not depend on the kernel before, so these
    // loads go out before waiting for it.
    unsigned q0[U][T][P], q1[U][T][P];
    auto load_groups = [&](int gb) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int g = gb + 8 * u;
            if (g < ng) {
                long long at = (long long)g * (G / 8) + t * P;
#pragma unroll
                for (int i = 0; i < T; ++i) {
                    load_words<P, SM>(w0[i], at, q0[u][i]);
                    load_words<P, SM>(w1[i], at, q1[u][i]);
                }
            }
        }
    };
    const int rows = min(16 * T, N - n0);
    if (SM) {
        // One bulk copy per row of words (to its padded place) and one each for the scales and
        // biases, all completing on one barrier; issued before the wait, as weights never depend
        // on an earlier kernel, so the tile fills while the kernels before still run.
        if (tid == 0) mbar_init(bar);
        __syncthreads();
        if (v == 0) {
            if (lane == 0) mbar_expect_tx(bar, (unsigned)rows * (K / 2 + ng * 4));
            __syncwarp();
            for (int r = lane; r < rows; r += 32)
                bulk_to_smem(tw + r * rs, W + (long long)(n0 + r) * nw, K / 2, bar);
            if (lane == 0) {
                bulk_to_smem(ts, S + (long long)n0 * ng, rows * ng * 2, bar);
                bulk_to_smem(tb, Bs + (long long)n0 * ng, rows * ng * 2, bar);
            }
        }
    } else {
        load_groups(v);
        // Scales and biases are used once per group by lanes t = 0: their rows (contiguous for
        // the block) are asked of L1 now, so those loads do not each wait on L2.
        l1_prefetch_range(S + (long long)n0 * ng, (long long)rows * ng * 2, tid, blockDim.x);
        l1_prefetch_range(Bs + (long long)n0 * ng, (long long)rows * ng * 2, tid, blockDim.x);
    }
    // The conv epilogue's weights and state are not written by the kernel before (the state
    // by this layer's step of the token before): asked of L1 now.
    const int conv_rows = io.conv_c > 0 ? max(0, min(rows, io.conv_c - n0)) : 0;
    float* conv_st = io.conv_state + (conv_rows ? (long long)io.slots[0] * (io.conv_k - 1) * io.conv_c : 0);
    if (tid < conv_rows) {
        l1_prefetch(io.conv_w + (long long)(n0 + tid) * io.conv_k);
        for (int j = 0; j + 1 < io.conv_k; ++j) l1_prefetch(conv_st + (long long)j * io.conv_c + n0 + tid);
    }
    if (io.norm)
        for (int k = tid * 32; k < K; k += 32 * blockDim.x) l1_prefetch(io.norm + k);
    pdl_entry();

    // With an input norm, x·norm is staged and x's sum of squares taken on the way; the row's
    // factor r is needed only for the outputs (Σ_k W[n, k]·x[k]·r·norm[k] = r·Σ_k W[n, k]·x[k]·norm[k]),
    // so the block's sum is met after the products.
    float ss = 0.f;
    for (int w = tid; w < nw; w += blockDim.x) {
        float4 a = *reinterpret_cast<const float4*>(x + 8 * w);
        float4 b = *reinterpret_cast<const float4*>(x + 8 * w + 4);
        if (io.norm) {
            ss += ((a.x * a.x + a.y * a.y) + (a.z * a.z + a.w * a.w)) + ((b.x * b.x + b.y * b.y) + (b.z * b.z + b.w * b.w));
            const float4 sa = *reinterpret_cast<const float4*>(io.norm + 8 * w);
            const float4 sb = *reinterpret_cast<const float4*>(io.norm + 8 * w + 4);
            a = make_float4(a.x * sa.x, a.y * sa.y, a.z * sa.z, a.w * sa.w);
            b = make_float4(b.x * sb.x, b.y * sb.y, b.z * sb.z, b.w * sb.w);
        }
        float lo4[4] = {a.x, a.y, a.z, a.w}, hi4[4] = {b.x, b.y, b.z, b.w};
        unsigned h[4], l[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            h[i] = pack_bf16(lo4[i], hi4[i]);
            l[i] = pack_bf16(lo4[i] - bf16lo(h[i]), hi4[i] - bf16hi(h[i]));
        }
        xs[2 * w] = make_uint4(h[0], h[1], h[2], h[3]);
        xs[2 * w + 1] = make_uint4(l[0], l[1], l[2], l[3]);
        ws[w] = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
        float hl = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) hl += (bf16lo(h[i]) + bf16hi(h[i])) + (bf16lo(l[i]) + bf16hi(l[i]));
        wh[w] = hl;
    }
    __syncthreads();
    for (int g = tid; g < ng; g += blockDim.x) {
        float sum = 0.f, sum_hl = 0.f;
        for (int w = g * (G / 8); w < (g + 1) * (G / 8); ++w) {
            sum += ws[w];
            sum_hl += wh[w];
        }
        gs[g] = sum;
        gh[g] = sum_hl;
    }
    __syncthreads();
    if (SM) {
        mbar_wait(bar, 0);
        load_groups(v);
    }

    float acc0[T], acc1[T];
#pragma unroll
    for (int i = 0; i < T; ++i) acc0[i] = acc1[i] = 0.f;
    for (int gb = v; gb < ng; gb += 8 * U) {
        if (gb != v) load_groups(gb);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int g = gb + 8 * u;
            if (g >= ng) break;
            float c[T][4];
#pragma unroll
            for (int i = 0; i < T; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
#pragma unroll
            for (int j = 0; j < P; ++j) {
                int wpos = g * (G / 8) + t * P + j;
                // Column 0 of B is x_hi (lanes gid = 0), column 1 x_lo (gid = 1): one product
                // takes both halves.
                uint4 xb = make_uint4(0u, 0u, 0u, 0u);
                if (gid < 2) xb = xs[2 * wpos + gid];
#pragma unroll
                for (int st = 0; st < 2; ++st) {
                    unsigned b0 = st == 0 ? xb.x : xb.z, b1 = st == 0 ? xb.y : xb.w;
#pragma unroll
                    for (int i = 0; i < T; ++i) {
                        unsigned a0 = nib_pair(q0[u][i][j], 2 * st), a1 = nib_pair(q1[u][i][j], 2 * st);
                        unsigned a2 = nib_pair(q0[u][i][j], 2 * st + 1), a3 = nib_pair(q1[u][i][j], 2 * st + 1);
                        mma_bf16(c[i], a0, a1, a2, a3, b0, b1);
                    }
                }
            }
            if (t == 0) {
                float xg = gs[g], off = 128.f * gh[g];
#pragma unroll
                for (int i = 0; i < T; ++i) {
                    long long a0 = SM ? (r0[i] - n0) * ng + g : r0[i] * ng + g;
                    long long a1 = SM ? (r1[i] - n0) * ng + g : r1[i] * ng + g;
                    const bf16_t* sc = SM ? ts : S;
                    const bf16_t* bi = SM ? tb : Bs;
                    acc0[i] = fmaf(bf16f(sc[a0]), (c[i][0] + c[i][1]) - off, fmaf(bf16f(bi[a0]), xg, acc0[i]));
                    acc1[i] = fmaf(bf16f(sc[a1]), (c[i][2] + c[i][3]) - off, fmaf(bf16f(bi[a1]), xg, acc1[i]));
                }
            }
        }
    }
    if (t == 0) {
#pragma unroll
        for (int i = 0; i < T; ++i) {
            red[v][16 * i + gid] = acc0[i];
            red[v][16 * i + gid + 8] = acc1[i];
        }
    }
    // The input norm's factor: the warps' sums of squares meet in shared memory.
    __shared__ float ssq[8];
    if (io.norm) {
        ss = warp_sum(ss);
        if (lane == 0) ssq[v] = ss;
    }
    __syncthreads();
    float r_norm = 1.f;
    if (io.norm) {
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) total += ssq[i];
        r_norm = rsqrtf(total / K + io.eps);
        if (io.normed && blockIdx.x == 0)
            for (int k = tid; k < K; k += blockDim.x) io.normed[k] = x[k] * r_norm * io.norm[k];
    }
    for (int r = tid; r < 16 * T; r += blockDim.x) {
        if (n0 + r < N) {
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) sum += red[i][r];
            float out = sum * r_norm + (bias ? bias[n0 + r] : 0.f);
            if (io.accumulate) out = y[n0 + r] + out;
            y[n0 + r] = out;
            if (r < conv_rows) {
                float wv[CONV_KMAX], sv[CONV_KMAX];
                conv_load(io.conv_w, conv_st, n0 + r, io.conv_c, io.conv_k, wv, sv);
                io.mixed[n0 + r] = conv_advance(wv, sv, conv_st, n0 + r, io.conv_c, io.conv_k, out);
            }
        }
    }
}

#define VEC_DISPATCH(T, SM)                                                   \
    if (G == 128) mma_vec_t<4, T, SM>(W, S, B, x, y, N, K, bias, io, red);        \
    else if (G == 64) mma_vec_t<2, T, SM>(W, S, B, x, y, N, K, bias, io, red);    \
    else mma_vec_t<1, T, SM>(W, S, B, x, y, N, K, bias, io, red);

#define VEC_TILES(SM)            \
    if (tiles == 4) {            \
        VEC_DISPATCH(4, SM)      \
    } else if (tiles == 3) {     \
        VEC_DISPATCH(3, SM)      \
    } else if (tiles == 2) {     \
        VEC_DISPATCH(2, SM)      \
    } else {                     \
        VEC_DISPATCH(1, SM)      \
    }

// tiles: row tiles of 16 per block (1 to 4).
extern "C" __global__ void __launch_bounds__(256, 2) mma_vec_affine4(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                                                                  const bf16_t* __restrict__ B, const float* __restrict__ x,
                                                                  float* __restrict__ y, int N, int K, int G, int tiles,
                                                                  const float* __restrict__ bias, const VecIo io) {
    long long n0 = (long long)blockIdx.x * 16 * tiles;
    l2_prefetch_rows(W, n0, 16 * tiles, N, K / 2, blockIdx.x);
    l2_prefetch_rows(S, n0, 16 * tiles, N, K / G * 2, blockIdx.x);
    l2_prefetch_rows(B, n0, 16 * tiles, N, K / G * 2, blockIdx.x);
    // mma_vec_t waits for the kernel before (pdl_entry) after its first weight loads.
    // The 8 warps' sums of the block's rows (one array for every instantiation).
    __shared__ float red[8][64];
    VEC_TILES(false)
}

// As mma_vec_affine4 with the block's rows of W, S and B staged in shared memory by bulk copies
// issued before the wait (one launch wave: every block resident while the kernel before runs).
// Needs K/G % 8 == 0 (the scale rows copied whole 16-byte units) and 16-byte aligned matrices.
extern "C" __global__ void __launch_bounds__(256, 2) mma_vec_affine4_staged(const unsigned* __restrict__ W, const bf16_t* __restrict__ S,
                                                                         const bf16_t* __restrict__ B, const float* __restrict__ x,
                                                                         float* __restrict__ y, int N, int K, int G, int tiles,
                                                                         const float* __restrict__ bias, const VecIo io) {
    __shared__ float red[8][64];
    VEC_TILES(true)
}
