// Prefill products at the precision the field runs them: bf16 activations and weights, f32
// accumulation. Dense projections go to cuBLASLt (cuda/gemm.rs) after these kernels put their
// operands in bf16; routed experts run the grouped kernel below. MLX affine weights are
// dequantized once to bf16: w = bf16(scale·q + bias) with one rounding of the exact value
// (fma.rn.bf16x2 on the exact codes), which the CPU twin (cpu::gemm_twin) reproduces bit for bit.
// Built with AFFINE_F16_ZERO (f16 scales s and zero points z, common.cuh's aff_scale and
// aff_bias), w = bf16((q − z)·s), likewise one rounding of the exact value; with AFFINE_F32 (f32
// scales and biases), w = bf16(fma(q, s, b)) (GroupSB below).
//
// rows_to_bf16: x f32 rows (row t at x + t·xs floats) → y bf16 [T, K] (round to nearest even).
//   grid (ceil(K / 256), T), block 256. rows_to_bf16_v4: the same four values a thread (float4
//   loads; xs, K multiples of 4), grid (ceil(K / 1024), T).
// dequant_affine_bf16: words u32 [N, K·bits/32] (LSB first), scales and biases bf16 [N, K/G] (or
//   f16 scales and zero points) → out bf16 [N, K]. grid ceil(N·K·bits/32 / 256), block 256: one
//   thread a word.
// dequant_fp8_bf16: FP8 codes [N, K] (four a word), f32 row scales [N, ceil(K/G)] → out bf16
//   [N, K], w = bf16(f32(e4m3(code) · scale)) (the CPU twin's rounding). Same grid, K % 4 == 0.
// swiglu_rows: gu f32 [T, 2I] ([gate | up] per row) → h f32 [T, I], h = silu(g)·u.
//   grid (ceil(I / 256), T), block 256.
//
// moe_gemm_{bf16,affine4,affine8,fp8}{,_swiglu}: the grouped expert product. Pairs are sorted by
// expert by `moe_group` (prefill.cu) in tiles of at most GB_M pairs; block x takes tile
// blockIdx.x (int3: expert e, first index f into `order`, count; blocks past n_tiles exit), whose
// input rows are pairs p = order[f + i] read as bf16 at X + (p / x_div)·xs (xs % 8 == 0). The
// weights are expert e's of a stack [E, N, K] (bf16, or affine words and scales as above; K % 8
// == 0 for bf16, K % 32 == 0 for affine, G ∈ {16, 32, 64, 128}: with 16, each half of a
// thread's 32 k takes its own group's; FP8 codes and f32 row scales as
// dequant_fp8_bf16, K % 32 == 0, G % 32 == 0).
//   Plain form: block y takes weight rows blockIdx.y·GB_N + 0..GB_N; Y f32 [pairs, N], row p.
//   SwiGLU form (N = 2I): block y takes outputs j = blockIdx.y·64 + 0..64, i.e. gate rows j and
//   up rows I + j; H bf16 [pairs, I], h = bf16(silu(gate·x)·(up·x)).
// grid (max_tiles, ceil(N / GB_N)) (ceil(I / 64) for SwiGLU), block 256, dynamic shared memory
// GEMM_SMEM bytes: two stages of the input tile [GB_M][GB_LD] and weight tile [GB_N][GB_LD]
// (bf16, GB_K = 64 of k per stage, rows padded to GB_LD so ldmatrix is conflict-free). Inputs
// and bf16 weights arrive by cp.async one stage ahead; affine words are loaded into registers
// one stage ahead and dequantized into the weight tile after the current stage's products.
// Warp w takes pairs 32·(w / 4) + 0..32 (two m16 tiles) against four n8 tiles of weight rows:
// 32·(w % 4) + 0..32 in the plain form; gate rows 16·(w % 4) + 0..16 and the up rows 64 above
// them in the SwiGLU form, so each thread holds the gate and up sums of the same outputs.

#define GB_M 64
#define GB_N 128
#define GB_K 64
#define GB_LD 72
#define GEMM_SMEM (2 * (GB_M + GB_N) * GB_LD * 2)

extern "C" __global__ void rows_to_bf16(const float* x, long long xs, bf16_t* __restrict__ y, int K) {
    pdl_entry();
    const int k = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (k < K) y[(long long)t * K + k] = f32_to_bf16_rn(x[(long long)t * xs + k]);
}

extern "C" __global__ void rows_to_bf16_v4(const float* x, long long xs, bf16_t* __restrict__ y, int K) {
    pdl_entry();
    const int k = 4 * (blockIdx.x * blockDim.x + threadIdx.x), t = blockIdx.y;
    if (k >= K) return;
    const float4 v = *reinterpret_cast<const float4*>(x + (long long)t * xs + k);
    *reinterpret_cast<uint2*>(y + (long long)t * K + k) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
}

__device__ __forceinline__ unsigned fma_bf16x2(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// A group's scale and bias in the form dequant_word applies them, from the stored values s and
// b: GroupSB{sb_scale(s), sb_bias(b, s)}. MLX (bf16 parameters): both splat as bf16x2, one
// fma.rn.bf16x2 a pair of codes. F16 zero points (AFFINE_F16_ZERO, common.cuh): s and −z·s in
// f32, one f32 fma a code, exact ((q − z)·s has at most 20 significant bits), so the one rounding
// is the conversion to bf16. f32 parameters (AFFINE_F32) take the same f32 fma, rounded to f32
// and then to bf16.
#if defined(AFFINE_F16_ZERO) || defined(AFFINE_F32)
#define GROUP_SB_F32
struct GroupSB {
    float s, b;
};
__device__ __forceinline__ float sb_scale(aff_t s) { return aff_scale(s); }
__device__ __forceinline__ float sb_bias(aff_t z, aff_t s) { return aff_bias(z, aff_scale(s)); }
#else
struct GroupSB {
    unsigned s, b;
};
__device__ __forceinline__ unsigned splat_bf16(aff_t v) { return (unsigned)v | ((unsigned)v << 16); }
__device__ __forceinline__ unsigned sb_scale(aff_t s) { return splat_bf16(s); }
__device__ __forceinline__ unsigned sb_bias(aff_t b, aff_t) { return splat_bf16(b); }
#endif

// The 32/BITS codes of word `w` (LSB first) dequantized as bf16x2 pairs: bf16(s·q + b), one
// rounding of the exact value.
template <int BITS>
__device__ __forceinline__ void dequant_word(unsigned w, GroupSB sb, unsigned* out) {
#pragma unroll
    for (int i = 0; i < 16 / BITS; ++i) {
        unsigned q0, q1;
        if (BITS == 4) {
            q0 = (w >> (8 * i)) & 15u;
            q1 = (w >> (8 * i + 4)) & 15u;
        } else {
            q0 = (w >> (16 * i)) & 255u;
            q1 = (w >> (16 * i + 8)) & 255u;
        }
#ifdef GROUP_SB_F32
        out[i] = pack_bf16(fmaf((float)q0, sb.s, sb.b), fmaf((float)q1, sb.s, sb.b));
#else
        const unsigned p = BITS == 4 ? codes4_bf16(q0, q1) : pack_bf16((float)q0, (float)q1);
        out[i] = fma_bf16x2(p, sb.s, sb.b);
#endif
    }
}

// The 4 FP8 codes of word `w` times `s`, as two bf16x2 pairs.
__device__ __forceinline__ void dequant_fp8_word(unsigned w, float s, unsigned* out) {
    float f[4];
    e4m3x4(w, f);
    out[0] = pack_bf16(f[0] * s, f[1] * s);
    out[1] = pack_bf16(f[2] * s, f[3] * s);
}

extern "C" __global__ void dequant_fp8_bf16(const unsigned* __restrict__ W, const float* __restrict__ S,
                                            bf16_t* __restrict__ out, int N, int K, int G) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int wpr = K / 4;
    if (i >= (long long)N * wpr) return;
    const long long n = i / wpr;
    const int k0 = (int)(i % wpr) * 4;
    unsigned v[2];
    dequant_fp8_word(W[i], S[n * ((K + G - 1) / G) + k0 / G], v);
    *reinterpret_cast<uint2*>(out + n * K + k0) = make_uint2(v[0], v[1]);
}

extern "C" __global__ void dequant_affine_bf16(const unsigned* __restrict__ W, const aff_t* __restrict__ S,
                                               const aff_t* __restrict__ Bs, bf16_t* __restrict__ out,
                                               int N, int K, int G, int bits) {
    pdl_entry();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per = 32 / bits, wpr = K / per;
    if (i >= (long long)N * wpr) return;
    const long long n = i / wpr;
    const int k0 = (int)(i % wpr) * per;
    const long long g = n * (K / G) + k0 / G;
    const GroupSB sb = {sb_scale(S[g]), sb_bias(Bs[g], S[g])};
    unsigned v[4];
    unsigned* o = reinterpret_cast<unsigned*>(out + n * K + k0);
    if (bits == 4) {
        dequant_word<4>(W[i], sb, v);
        reinterpret_cast<uint4*>(o)[0] = make_uint4(v[0], v[1], v[2], v[3]);
    } else {
        dequant_word<8>(W[i], sb, v);
        reinterpret_cast<uint2*>(o)[0] = make_uint2(v[0], v[1]);
    }
}

extern "C" __global__ void swiglu_rows(const float* gu, float* __restrict__ h, int I) {
    pdl_entry();
    const int j = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (j >= I) return;
    const float* r = gu + (long long)t * 2 * I;
    h[(long long)t * I + j] = silu_f(r[j]) * r[I + j];
}

// The block's weight rows: smem row r ↔ global row of expert e (clamped to the matrix; rows
// past it compute values that are never stored).
template <bool SW>
__device__ __forceinline__ int weight_row(int r, int N) {
    if (SW) {
        const int I = N >> 1, j = min(blockIdx.y * 64 + (r & 63), I - 1);
        return r < 64 ? j : I + j;
    }
    return min(blockIdx.y * GB_N + r, N - 1);
}

// The smem row of n8 tile j (0..3) of warp column wn.
template <bool SW>
__device__ __forceinline__ int tile_row(int wn, int j) {
    return SW ? (j < 2 ? 16 * wn + 8 * j : 64 + 16 * wn + 8 * (j - 2)) : 32 * wn + 8 * j;
}

// BITS 16: bf16; 4 or 8: affine; 9: FP8 (codes as 8-bit words, S the f32 row scales).
template <int BITS, bool SW>
__device__ __forceinline__ void moe_gemm(const void* __restrict__ W, const aff_t* __restrict__ S,
                                         const aff_t* __restrict__ Bs, const bf16_t* X, long long xs,
                                         int x_div, float* Y, bf16_t* H, int N, int K, int G,
                                         const int* tiles, const int* n_tiles, const int* order) {
    extern __shared__ __align__(16) unsigned char gemm_smem[];
    bf16_t* xs_t = reinterpret_cast<bf16_t*>(gemm_smem);      // [2][GB_M][GB_LD]
    bf16_t* ws_t = xs_t + 2 * GB_M * GB_LD;                    // [2][GB_N][GB_LD]
    pdl_entry();
    const int tile = blockIdx.x;
    if (tile >= n_tiles[0]) return;
    const int e = tiles[3 * tile], f = tiles[3 * tile + 1], cnt = tiles[3 * tile + 2];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;

    // Input rows this thread copies: chunks tid and tid + 256 of the 64 × 8 16-byte chunks.
    const bf16_t* xrow[2];
    int xr[2], xc[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int c = tid + 256 * u;
        xr[u] = c >> 3;
        xc[u] = (c & 7) * 8;
        xrow[u] = xr[u] < cnt ? X + (long long)(order[f + xr[u]] / x_div) * xs : X;
    }
    // Affine: this thread's weight row (tid / 2) and its half of each stage's 64 k.
    const int ar = tid >> 1, ah = tid & 1;
    const long long arow = (long long)e * N + weight_row<SW>(ar, N);
    constexpr int CB = BITS == 9 ? 8 : BITS;  // bits a code
    const int wpr = K * CB / 32;  // words per row (affine, FP8)
    constexpr int NW = BITS == 16 ? 1 : CB;  // words of 32 codes: 4 at 4 bits, 8 at 8
    unsigned wreg[NW];
    // The parameters of the half's group, and with groups of 16 of its second group.
    aff_t sreg = 0, breg = 0, sreg2 = 0, breg2 = 0;
    float freg = 0.f;

    auto load_x = [&](int kt, int st) {
        const int k0 = kt * GB_K;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const bool ok = xr[u] < cnt && k0 + xc[u] < K;
            cp_async16(xs_t + (st * GB_M + xr[u]) * GB_LD + xc[u], xrow[u] + (ok ? k0 + xc[u] : 0), ok);
        }
    };
    auto load_w = [&](int kt, int st) {
        const int k0 = kt * GB_K;
        if (BITS == 16) {
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int c = tid + 256 * u, r = c >> 3, kc = (c & 7) * 8;
                const long long row = (long long)e * N + weight_row<SW>(r, N);
                const bool ok = k0 + kc < K;
                const bf16_t* src = reinterpret_cast<const bf16_t*>(W) + row * K + (ok ? k0 + kc : 0);
                cp_async16(ws_t + (st * GB_N + r) * GB_LD + kc, src, ok);
            }
        } else {
            const int kh = k0 + 32 * ah;
            if (kh < K) {
                const unsigned* src = reinterpret_cast<const unsigned*>(W) + arow * wpr + kh * CB / 32;
#pragma unroll
                for (int u = 0; u < NW / 4; ++u) {
                    uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + u);
                    wreg[4 * u] = v.x; wreg[4 * u + 1] = v.y; wreg[4 * u + 2] = v.z; wreg[4 * u + 3] = v.w;
                }
                if (BITS == 9) {
                    freg = reinterpret_cast<const float*>(S)[arow * ((K + G - 1) / G) + kh / G];
                } else {
                    const long long g = arow * (K / G) + kh / G;
                    sreg = S[g];
                    breg = Bs[g];
                    if (G == 16) {
                        sreg2 = S[g + 1];
                        breg2 = Bs[g + 1];
                    }
                }
            }
        }
    };
    auto store_w = [&](int kt, int st) {
        if (BITS == 16) return;
        const int kh = kt * GB_K + 32 * ah;
        uint4* dst = reinterpret_cast<uint4*>(ws_t + (st * GB_N + ar) * GB_LD + 32 * ah);
        if (kh >= K) {
#pragma unroll
            for (int u = 0; u < 4; ++u) dst[u] = make_uint4(0, 0, 0, 0);
            return;
        }
        unsigned v[16];
        if (BITS == 9) {
#pragma unroll
            for (int w = 0; w < NW; ++w) dequant_fp8_word(wreg[w], freg, v + 2 * w);
        } else {
            const GroupSB sb = {sb_scale(sreg), sb_bias(breg, sreg)};
            const GroupSB sb2 = G == 16 ? GroupSB{sb_scale(sreg2), sb_bias(breg2, sreg2)} : sb;
#pragma unroll
            for (int w = 0; w < NW; ++w)
                dequant_word<(BITS == 16 || BITS == 9 ? 4 : BITS)>(wreg[w], w < NW / 2 ? sb : sb2, v + w * (16 / NW));
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) dst[u] = make_uint4(v[4 * u], v[4 * u + 1], v[4 * u + 2], v[4 * u + 3]);
    };

    float acc[2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

    const int KT = (K + GB_K - 1) / GB_K;
    load_x(0, 0);
    load_w(0, 0);
    cp_async_commit();
    store_w(0, 0);
    for (int kt = 0; kt < KT; ++kt) {
        const int st = kt & 1;
        cp_async_wait_all();
        __syncthreads();
        if (kt + 1 < KT) {
            load_x(kt + 1, st ^ 1);
            load_w(kt + 1, st ^ 1);
        }
        cp_async_commit();
        const bf16_t* xa = xs_t + st * GB_M * GB_LD;
        const bf16_t* wb = ws_t + st * GB_N * GB_LD;
#pragma unroll
        for (int kk = 0; kk < GB_K; kk += 16) {
            unsigned a[2][4], b[4][2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
                ldsm_x4(a[mt], xa + (32 * wm + 16 * mt + (lane & 15)) * GB_LD + kk + 8 * (lane >> 4));
#pragma unroll
            for (int jp = 0; jp < 2; ++jp) {
                unsigned r[4];
                const int j = 2 * jp + (lane >> 4);
                ldsm_x4(r, wb + (tile_row<SW>(wn, j) + (lane & 7)) * GB_LD + kk + 8 * ((lane >> 3) & 1));
                b[2 * jp][0] = r[0]; b[2 * jp][1] = r[1];
                b[2 * jp + 1][0] = r[2]; b[2 * jp + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int j = 0; j < 4; ++j) mma_bf16(acc[mt][j], a[mt], b[j][0], b[j][1]);
        }
        if (kt + 1 < KT) store_w(kt + 1, st ^ 1);
    }

    // Epilogue: c[0..2] are pair row gid, columns 2·tig, 2·tig + 1 of the n8 tile; c[2..4] row gid + 8.
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int m = 32 * wm + 16 * mt + gid + 8 * hh;
            if (m >= cnt) continue;
            const long long p = order[f + m];
            if (SW) {
                const int I = N >> 1;
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int o = blockIdx.y * 64 + 16 * wn + 8 * j + 2 * tig + c;
                        if (o < I) {
                            const float g = acc[mt][j][2 * hh + c], u = acc[mt][j + 2][2 * hh + c];
                            H[p * I + o] = f32_to_bf16_rn(silu_f(g) * u);
                        }
                    }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int n = blockIdx.y * GB_N + 32 * wn + 8 * j + 2 * tig + c;
                        if (n < N) Y[p * N + n] = acc[mt][j][2 * hh + c];
                    }
            }
        }
}

#define MOE_GEMM(name, BITS, SW)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) name(                                            \
        const void* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ Bs,        \
        const bf16_t* X, long long xs, int x_div, float* Y, bf16_t* H, int N, int K, int G,             \
        const int* tiles, const int* n_tiles, const int* order) {                                       \
        moe_gemm<BITS, SW>(W, S, Bs, X, xs, x_div, Y, H, N, K, G, tiles, n_tiles, order);               \
    }
MOE_GEMM(moe_gemm_bf16, 16, false)
MOE_GEMM(moe_gemm_bf16_swiglu, 16, true)
MOE_GEMM(moe_gemm_affine4, 4, false)
MOE_GEMM(moe_gemm_affine4_swiglu, 4, true)
MOE_GEMM(moe_gemm_affine8, 8, false)
MOE_GEMM(moe_gemm_affine8_swiglu, 8, true)
MOE_GEMM(moe_gemm_fp8, 9, false)
MOE_GEMM(moe_gemm_fp8_swiglu, 9, true)
