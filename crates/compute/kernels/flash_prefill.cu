// Causal gated attention for prefill on tensor cores (flash attention: K/V tiles stream through
// shared memory once per block, the softmax is computed online per query row in f32).
//
// flash_prefill_<DT> (DT = 64, 128, 256: the head dim D ≤ DT, zero-padded to DT):
//   T query rows of one sequence at positions pos0 + t; q: f32 [T, Hq, D] (normed, roped); the
//   slot's caches k, v: f32 [ctx, Hkv, D] (rows 0..pos0 + T written); gates in the projection
//   rows (P floats per row; head h's gate at h·2D + D, as attn_prep lays them out);
//   out[t, h·D + d] = Σ_{p ≤ pos0+t} softmax_p(q_t,h · k_p / sqrt(D)) v_p[d] · sigmoid(gate[d]),
//   with kv head h / (Hq / Hkv) (GQA).
//
// Work split: the q heads of one kv head share every K/V tile. Block rows are the flattened pairs
//   r = t·G + g (token t, head g of the G = Hq/Hkv heads of kv head blockIdx.y); block x takes
//   BM = 16·NW consecutive pairs (blocks in reverse so the longest rows start first), warp w the
//   16 pairs 16w.. of them. grid (ceil(T·G / BM), Hkv), block NW·32 threads, NW ≤ 8 chosen by
//   the launcher (smaller when T·G is small or shared memory is short).
//
// Per K/V tile of FP_BN = 32 positions: the block loads K [32][DT] and Vᵀ [DT][32] as bf16 hi and
//   lo parts (x_hi = bf16(x), x_lo = bf16(x − x_hi); positions past the block's last visible one
//   are zero); each warp computes S = Q Kᵀ (16 × 32) with mma.sync m16n8k16 bf16 → f32 as
//   Q_hi K_hi + Q_lo K_hi + Q_hi K_lo (the dropped Q_lo K_lo and the rounding of the lo parts are
//   ~2⁻¹⁶ relative per product), masks positions past each row's pos0 + t, updates the running
//   max m and sum l (exp2 of scores pre-scaled by log2(e)/sqrt(D)), rescales its O accumulator
//   and adds P V as P_hi V_hi + P_lo V_hi + P_hi V_lo, P taken straight from the S fragments.
//   A warp whose rows see none of a tile skips it.
//
// Fragments (m16n8k16, lane = 4·gid + tq): A (16×16, row major): a0 = A[gid][2tq, 2tq+1],
//   a1 = A[gid+8][2tq..], a2 = A[gid][2tq+8..], a3 = A[gid+8][2tq+8..]; B (16×8, k × n):
//   b0 = B[2tq, 2tq+1][gid], b1 = B[2tq+8, 2tq+9][gid]; C (16×8): c0, c1 = C[gid][2tq, 2tq+1],
//   c2, c3 = C[gid+8][2tq..]. Pairs along k are one 32-bit word (lower k in the low half), so
//   Q and K are stored [row][d] and V transposed [d][position], each row padded by 4 words
//   (conflict-free fragment reads).
//
// Dynamic shared memory, 32-bit words: 2·BM·QS (Q hi, lo) + 2·FP_BN·QS (K hi, lo) + 2·DT·VS
//   (Vᵀ hi, lo) with QS = DT/2 + 4, VS = FP_BN/2 + 4 (205 KiB for DT = 256, NW = 8).
//
// flash_prefill_<DT>_bf16: the same with q, k, v and P rounded to bf16 once (the hi parts only:
//   one product where the split form takes three, as flash attention does; f32 accumulation and
//   softmax), and half the shared memory (no lo parts). k and v arrive as bf16 copies of the
//   caches' rows ([pos0 + T, Hkv, D], the same layout; `rows_to_bf16`), read 16 bytes at a time
//   when D % 8 == 0.

#define FP_BN 32
#define FP_VS (FP_BN / 2 + 4)

// The hi word of (x0, x1) and the lo word of what it leaves.
__device__ __forceinline__ void fp_split(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = pack_bf16(x0, x1);
    lo = pack_bf16(x0 - bf16lo(hi), x1 - bf16hi(hi));
}

// Element i of a K/V array: f32 caches in the split form, bf16 copies in the bf16 form.
template <bool SPLIT>
__device__ __forceinline__ float kv_at(const float* base, long long i) {
    return SPLIT ? base[i] : bf16f(reinterpret_cast<const bf16_t*>(base)[i]);
}

// Stores the hi word of (x0, x1) and, when SPLIT, the lo word.
template <bool SPLIT>
__device__ __forceinline__ void fp_put(float x0, float x1, unsigned* hi, unsigned* lo) {
    unsigned h, l;
    fp_split(x0, x1, h, l);
    *hi = h;
    if (SPLIT) *lo = l;
}

template <int DT, bool SPLIT>
__device__ __forceinline__ void flash_prefill_t(const float* q, const float* kc,
                                                const float* vc, const float* proj,
                                                long long P, float* __restrict__ out, int T, int pos0, int Hq,
                                                int Hkv, int D, float scale_log2) {
    constexpr int QS = DT / 2 + 4;
    constexpr int HW = DT / 2;  // words per unpadded row
    extern __shared__ __align__(16) unsigned fp_smem[];
    const int nw = blockDim.x >> 5, BM = nw * 16;
    // Without SPLIT the lo arrays alias the hi ones: written with the same values, never read.
    constexpr int LO = SPLIT ? 1 : 0;
    unsigned* Qh = fp_smem;
    unsigned* Ql = Qh + LO * BM * QS;
    unsigned* Kh = Ql + BM * QS;
    unsigned* Kl = Kh + LO * FP_BN * QS;
    unsigned* Vh = Kl + FP_BN * QS;
    unsigned* Vl = Vh + LO * DT * FP_VS;
    const int G = Hq / Hkv, kvh = blockIdx.y;
    const int nrows = T * G, r0 = (gridDim.x - 1 - blockIdx.x) * BM;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tq = lane & 3;
    const long long kv_row = (long long)Hkv * D, kv_off = (long long)kvh * D;

    for (int i = threadIdx.x; i < BM * HW; i += blockDim.x) {
        int r = i / HW, w = i % HW, d = 2 * w, fr = r0 + r;
        float x0 = 0.f, x1 = 0.f;
        if (fr < nrows) {
            const float* src = q + ((long long)(fr / G) * Hq + kvh * G + fr % G) * D;
            if (d < D) x0 = src[d];
            if (d + 1 < D) x1 = src[d + 1];
        }
        fp_put<SPLIT>(x0, x1, &Qh[r * QS + w], &Ql[r * QS + w]);
    }
    // Last visible position of this thread's rows gid, gid + 8 (−1: no row), of the warp's and
    // of the block's rows.
    int lim[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        int fr = r0 + warp * 16 + gid + 8 * e;
        lim[e] = fr < nrows ? pos0 + fr / G : -1;
    }
    int wlast = min(r0 + warp * 16 + 15, nrows - 1);
    int wlim = wlast >= r0 + warp * 16 ? pos0 + wlast / G : -1;
    int blim = pos0 + (min(r0 + BM, nrows) - 1) / G;

    float o[DT / 8][4];
#pragma unroll
    for (int n = 0; n < DT / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    for (int p0 = 0; p0 <= blim; p0 += FP_BN) {
        __syncthreads();
        if (!SPLIT && (D & 7) == 0) {
            // bf16 K/V rows: 16-byte chunks of 8 values straight into the tiles (V as pairs of
            // positions per d, the two rows' halves interleaved by byte permutes).
            const bf16_t* kb = reinterpret_cast<const bf16_t*>(kc);
            const bf16_t* vb = reinterpret_cast<const bf16_t*>(vc);
            constexpr int CH = DT / 8;
            for (int i = threadIdx.x; i < FP_BN * CH; i += blockDim.x) {
                const int j = i / CH, c = i % CH, p = p0 + j;
                uint4 v = make_uint4(0, 0, 0, 0);
                if (p <= blim && 8 * c < D) v = *reinterpret_cast<const uint4*>(kb + p * kv_row + kv_off + 8 * c);
                *reinterpret_cast<uint4*>(&Kh[j * QS + 4 * c]) = v;
            }
            for (int i = threadIdx.x; i < (FP_BN / 2) * CH; i += blockDim.x) {
                const int w = i / CH, c = i % CH, p = p0 + 2 * w;
                uint4 a = make_uint4(0, 0, 0, 0), b = a;
                if (8 * c < D) {
                    const bf16_t* src = vb + p * kv_row + kv_off + 8 * c;
                    if (p <= blim) a = *reinterpret_cast<const uint4*>(src);
                    if (p + 1 <= blim) b = *reinterpret_cast<const uint4*>(src + kv_row);
                }
                const unsigned aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    Vh[(8 * c + 2 * e) * FP_VS + w] = __byte_perm(aw[e], bw[e], 0x5410);
                    Vh[(8 * c + 2 * e + 1) * FP_VS + w] = __byte_perm(aw[e], bw[e], 0x7632);
                }
            }
        } else {
#pragma unroll 4
            for (int i = threadIdx.x; i < FP_BN * HW; i += blockDim.x) {
                int j = i / HW, w = i % HW, d = 2 * w, p = p0 + j;
                float x0 = 0.f, x1 = 0.f;
                if (p <= blim) {
                    const long long at = (long long)p * kv_row + kv_off;
                    if (d < D) x0 = kv_at<SPLIT>(kc, at + d);
                    if (d + 1 < D) x1 = kv_at<SPLIT>(kc, at + d + 1);
                }
                fp_put<SPLIT>(x0, x1, &Kh[j * QS + w], &Kl[j * QS + w]);
            }
#pragma unroll 4
            for (int i = threadIdx.x; i < DT * (FP_BN / 2); i += blockDim.x) {
                int d = i % DT, w = i / DT, p = p0 + 2 * w;
                float x0 = 0.f, x1 = 0.f;
                if (d < D) {
                    const long long at = (long long)p * kv_row + kv_off + d;
                    if (p <= blim) x0 = kv_at<SPLIT>(vc, at);
                    if (p + 1 <= blim) x1 = kv_at<SPLIT>(vc, at + kv_row);
                }
                fp_put<SPLIT>(x0, x1, &Vh[d * FP_VS + w], &Vl[d * FP_VS + w]);
            }
        }
        __syncthreads();
        if (p0 > wlim) continue;

        // S = Q Kᵀ for the warp's 16 rows and the tile's 32 positions (4 n-tiles of 8).
        float s[FP_BN / 8][4];
#pragma unroll
        for (int j = 0; j < FP_BN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        const unsigned* qh = Qh + (warp * 16 + gid) * QS + tq;
        const unsigned* ql = Ql + (warp * 16 + gid) * QS + tq;
#pragma unroll
        for (int ks = 0; ks < DT / 16; ++ks) {
            unsigned ah[4] = {qh[8 * ks], qh[8 * QS + 8 * ks], qh[8 * ks + 4], qh[8 * QS + 8 * ks + 4]};
            unsigned al[4] = {ql[8 * ks], ql[8 * QS + 8 * ks], ql[8 * ks + 4], ql[8 * QS + 8 * ks + 4]};
#pragma unroll
            for (int j = 0; j < FP_BN / 8; ++j) {
                const unsigned* kh = Kh + (8 * j + gid) * QS + 8 * ks + tq;
                const unsigned* kl = Kl + (8 * j + gid) * QS + 8 * ks + tq;
                unsigned bh0 = kh[0], bh1 = kh[4];
                if (SPLIT) {
                    mma_bf16(s[j], al, bh0, bh1);
                    mma_bf16(s[j], ah, kl[0], kl[4]);
                }
                mma_bf16(s[j], ah, bh0, bh1);
            }
        }

        // Online softmax (scores in log2 units); masked entries are −inf.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < FP_BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int p = p0 + 8 * j + 2 * tq + (e & 1), row = e >> 1;
                float v = p <= lim[row] ? s[j][e] * scale_log2 : NEG_INF;
                s[j][e] = v;
                mx[row] = fmaxf(mx[row], v);
            }
#pragma unroll
        for (int row = 0; row < 2; ++row) {
            mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 1));
            mx[row] = fmaxf(mx[row], __shfl_xor_sync(0xffffffffu, mx[row], 2));
            float mn = fmaxf(m[row], mx[row]);
            float corr = mn == NEG_INF ? 1.f : exp2f(m[row] - mn);
            m[row] = mn;
            l[row] *= corr;
#pragma unroll
            for (int n = 0; n < DT / 8; ++n) {
                o[n][2 * row] *= corr;
                o[n][2 * row + 1] *= corr;
            }
        }
#pragma unroll
        for (int j = 0; j < FP_BN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int row = e >> 1;
                float pv = m[row] == NEG_INF ? 0.f : exp2f(s[j][e] - m[row]);
                l[row] += pv;
                s[j][e] = pv;
            }

        // O += P V: the k16 step kk covers positions 16kk..16kk+15 = S n-tiles 2kk, 2kk+1.
#pragma unroll
        for (int kk = 0; kk < FP_BN / 16; ++kk) {
            unsigned ph[4], pl[4];
            fp_split(s[2 * kk][0], s[2 * kk][1], ph[0], pl[0]);
            fp_split(s[2 * kk][2], s[2 * kk][3], ph[1], pl[1]);
            fp_split(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[2], pl[2]);
            fp_split(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
            for (int n = 0; n < DT / 8; ++n) {
                const unsigned* vh = Vh + (8 * n + gid) * FP_VS + 8 * kk + tq;
                const unsigned* vl = Vl + (8 * n + gid) * FP_VS + 8 * kk + tq;
                unsigned bh0 = vh[0], bh1 = vh[4];
                if (SPLIT) {
                    mma_bf16(o[n], pl, bh0, bh1);
                    mma_bf16(o[n], ph, vl[0], vl[4]);
                }
                mma_bf16(o[n], ph, bh0, bh1);
            }
        }
    }

#pragma unroll
    for (int row = 0; row < 2; ++row) {
        l[row] += __shfl_xor_sync(0xffffffffu, l[row], 1);
        l[row] += __shfl_xor_sync(0xffffffffu, l[row], 2);
        int fr = r0 + warp * 16 + gid + 8 * row;
        if (fr >= nrows) continue;
        int t = fr / G, h = kvh * G + fr % G;
        const float* gate = proj + (long long)t * P + (long long)h * 2 * D + D;
        float* dst = out + ((long long)t * Hq + h) * D;
        float inv = 1.f / l[row];
#pragma unroll
        for (int n = 0; n < DT / 8; ++n) {
            int d = 8 * n + 2 * tq;
            if (d < D) dst[d] = o[n][2 * row] * inv * sigmoid_f(gate[d]);
            if (d + 1 < D) dst[d + 1] = o[n][2 * row + 1] * inv * sigmoid_f(gate[d + 1]);
        }
    }
}

#define FP_KERNEL(name, DT, SPLIT)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) name(                                            \
        const float* q, const float* kc, const float* vc,                                              \
        const float* proj, long long P, float* __restrict__ out, int T, int pos0, int Hq,              \
        int Hkv, int D, float scale_log2) {                                                            \
        pdl_entry();                                                                                   \
        flash_prefill_t<DT, SPLIT>(q, kc, vc, proj, P, out, T, pos0, Hq, Hkv, D, scale_log2);          \
    }

FP_KERNEL(flash_prefill_64, 64, true)
FP_KERNEL(flash_prefill_128, 128, true)
FP_KERNEL(flash_prefill_256, 256, true)
FP_KERNEL(flash_prefill_64_bf16, 64, false)
FP_KERNEL(flash_prefill_128_bf16, 128, false)
FP_KERNEL(flash_prefill_256_bf16, 256, false)
