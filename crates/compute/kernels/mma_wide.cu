// Wide form of the batched products (decode batches from 8 rows), at the accuracy and in the
// fragment layout of mma_frag.cuh (prefixed to this file): y[b, n] = Σ_k W[n, k] x[b, k]
// (+ bias[n]), or h[b, n] = silu(G_n·x_b)·U_n·x_b for SwiGLU (W = [gate (I rows) | up (I rows)]).
//
// The inputs are staged first, once per product, by wide_stage_rows: each row as the bf16 hi/lo
// pairs of the mma B fragments in the order the blocks read them, and (affine weights) the sums
// of its groups. Dense (mma_wide_*): grid (ceil(B / 32), ceil(outputs / 128) (SwiGLU: / 64),
// ks), block 256; block (x, y, z) takes inputs 32x + 0..32 and the K stages [z·spb, (z + 1)·spb).
// Grouped (mma_gwide_*, a decode batch's expert pairs by expert): grid (tiles, same y), see
// mma_gwide_t. Dynamic shared memory as `Wide<BITS, MT>` lays it out, for the largest tile count
// of the launch (the host computes the same size).
//
// Affine weights' scales and biases ([E, N, K/G] each, G = 32, 64 or 128) are `aff_t`
// (common.cuh): 16-bit (bf16, or f16 scales and zero points), or f32 in the AFFINE_F32 build.
// That build also takes 8-bit codes in groups of 16 (AFFINE_G16): each k16 step then holds one
// group, lane t's values of a chunk being k = 4t..4t+3 (step 0, the chunk's first group) and
// 16 + 4t..16 + 4t + 3 (step 1), and the dequant form is applied after each step.
//
// A block holds 128 weight rows in shared memory, warp w rows 16w + 0..16: 128 outputs, or for
// SwiGLU 64 outputs' gate rows (warps 0..3) and up rows (4..7), whose sums meet in shared memory
// at the end. A stage is WIDE_ROWB bytes of each row: KST = 8·WIDE_ROWB / BITS inputs (128 at 4
// bits, 64 at 8, 32 for bf16). Its weights, the scales and biases of its groups, the staged
// inputs of the block's rows and their group sums are copied by cp.async into one of P shared
// buffers P − 1 stages ahead of its products (the weights of the first stages before the wait on
// the kernel before, the rest after it). Products run per k16 step over every 8-row tile, so
// that back-to-back mmas go to independent accumulators. One barrier a stage. The dequant form
// is applied once a group; a block's stages hold whole groups. Needs K % 256 == 0 (whole stages,
// and each row's scales, when 16-bit, starting at an even index).
//
// Dense with ks = 1 writes y (SwiGLU: h); else the partial sums (gate and up rows apart) go to
// part [ks, B, sets·N], which `wide_sum` adds in order of z.

#define WIDE_STAGES 4
#define WIDE_ROWB 64
// Row stride of a staged weight row: 80 bytes (20 words), so the 8 rows of a warp's 32-bit
// fragment reads fall in distinct banks.
#define WIDE_WLD 80
// Bytes staged per row for each of scales and biases: a stage's slice (at most 4 groups) as
// whole words, up to 3 of 16-bit parameters (from an offset of one when the slice does not start
// on a word) or 4 of f32 ones (which always start on a word).
#define WIDE_SBB 16
// Affine parameters a 32-bit word holds (2, or 1 for f32), and the most words a slice takes.
#define WIDE_PPW (4 / (int)sizeof(aff_t))
#define WIDE_SBW (WIDE_PPW == 2 ? 3 : 4)

// One stage's shared buffers for `BITS`-bit weights and MT tiles of 8 input rows: weights,
// scales and biases (affine), inputs (row stride XW words: SUB chunks of 32 words, plus 4 so
// that rows gid and gid + 1 of a quarter-warp's 16-byte reads take other banks), group sums (4
// floats a row). P buffers (3 for 4 tiles, so that two blocks fit a multiprocessor).
template <int BITS, int MT>
struct Wide {
    static constexpr int KST = 8 * WIDE_ROWB / BITS;
    static constexpr int SUB = KST / 32;
    static constexpr int XW = SUB * 32 + 4;
    static constexpr int P = MT == 4 ? WIDE_STAGES - 1 : WIDE_STAGES;
    static constexpr int W_BYTES = 128 * WIDE_WLD;
    static constexpr int S_BYTES = BITS == 16 ? 0 : 2 * 128 * WIDE_SBB;
    static constexpr int X_BYTES = 8 * MT * XW * 4;
    static constexpr int U_BYTES = BITS == 16 ? 0 : 8 * MT * 16;
    static constexpr int STAGE = W_BYTES + S_BYTES + X_BYTES + U_BYTES;
};

// wide_stage_rows: row r of x (at x + r·xs, K floats) as K/32 chunks of 32 words at
// out + (r·K/32 + c)·32: per lane group t = 0..3 and k16 step st = 0..1, at word 8t + 4st, the
// bf16 hi pair then the lo pair (x_hi = bf16(x), x_lo = bf16(x − x_hi)) of values
// 32c + 8t + 2st + {0, 1} and (affine: the pairs (k_i, k_{i+4}) wide_frag makes) 32c + 8t + 4 +
// 2st + {0, 1}, or (bf16 weights) 32c + 4q + 0..3 for word 4q; with groups of 16 (G = 16) the
// pairs of values 32c + 16st + 4t + {0, 1} and + {2, 3}. Affine: the sum over each group
// of G inputs of x_hi + x_lo goes to sums[(r·K/kst + s)·4 + i], s the stage of kst inputs where
// the group ends, i its index among the stage's groups (0 when a group spans stages).
// grid (ceil(K / 1024), rows), block 256; K % 256 == 0, so that whole warps fall past K.
extern "C" __global__ void wide_stage_rows(const float* x, long long xs, unsigned* out, float* sums, int K,
                                           int kst, int G, int affine) {
    pdl_entry();
    const int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x, c = i >> 3, q = i & 7;
    if (4 * i >= K) return;
    const float* p = x + (long long)r * xs + 32 * c;
    float v[4];
    const bool g16 = affine && G == 16;
    if (g16) {
        const float4 a = *reinterpret_cast<const float4*>(p + 16 * (q & 1) + 4 * (q >> 1));
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    } else if (affine) {
        const int o = 8 * (q >> 1) + 2 * (q & 1);
        const float2 a = *reinterpret_cast<const float2*>(p + o), b = *reinterpret_cast<const float2*>(p + o + 4);
        v[0] = a.x; v[1] = b.x; v[2] = a.y; v[3] = b.y;
    } else {
        const float4 a = *reinterpret_cast<const float4*>(p + 4 * q);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    }
    const unsigned h0 = pack_bf16(v[0], v[1]), h1 = pack_bf16(v[2], v[3]);
    const unsigned l0 = pack_bf16(v[0] - bf16lo(h0), v[1] - bf16hi(h0));
    const unsigned l1 = pack_bf16(v[2] - bf16lo(h1), v[3] - bf16hi(h1));
    *reinterpret_cast<uint4*>(out + ((long long)r * (K >> 5) + c) * 32 + 4 * q) = make_uint4(h0, h1, l0, l1);
    if (!affine) return;
    float su = ((bf16lo(h0) + bf16lo(l0)) + (bf16hi(h0) + bf16hi(l0))) +
               ((bf16lo(h1) + bf16lo(l1)) + (bf16hi(h1) + bf16hi(l1)));
    if (g16) {
        // Group 2c + st is threads q = st, st + 2, st + 4, st + 6 of the chunk.
        su += __shfl_xor_sync(0xffffffffu, su, 2);
        su += __shfl_xor_sync(0xffffffffu, su, 4);
        if (q < 2) {
            const int g = 2 * c + q;
            sums[((long long)r * (K / kst) + 16 * g / kst) * 4 + (16 * g % kst) / 16] = su;
        }
        return;
    }
    for (int o = 1; o < G / 4; o <<= 1) su += __shfl_xor_sync(0xffffffffu, su, o);
    if ((i & (G / 4 - 1)) == 0) {
        const int g = 4 * i / G, s = ((g + 1) * G - 1) / kst, slot = G <= kst ? (g * G % kst) / G : 0;
        sums[((long long)r * (K / kst) + s) * 4 + slot] = su;
    }
}

// Affine codes enter in pairs (k_i, k_{i+4}) of each lane's 8 values, i = 0..3. 4 bits: one
// shift and one lop3 make (128 + k_i, 128 + k_{i+4}) as bf16x2, exact; the 128s come off with
// the group's bias (wide_core). 8 bits: the codes themselves, exact. Groups of 16 (8 bits): the
// words at `at` and at + 16 bytes, as pairs of bytes (0, 1), (2, 3) of each.
template <int BITS, bool G16>
__device__ __forceinline__ void wide_frag(const unsigned char* at, unsigned p[4]) {
    if constexpr (G16) {
        const unsigned v[2] = {*reinterpret_cast<const unsigned*>(at), *reinterpret_cast<const unsigned*>(at + 16)};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // 2^23 + k as f32 bits, minus 2^23: exact.
            const unsigned w = v[i >> 1], b = 2 * (i & 1);
            float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | b)) - 8388608.f;
            float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | (b + 1))) - 8388608.f;
            p[i] = pack_bf16(lo, hi);
        }
    } else if constexpr (BITS == 4) {
        const unsigned v = *reinterpret_cast<const unsigned*>(at);
        // The magic in a register, so that mask and magic make one lop3 ((a & b) | c).
        unsigned magic;
        asm("mov.b32 %0, 0x43004300;" : "=r"(magic));
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xEA;" : "=r"(p[i]) : "r"(v >> (4 * i)), "r"(magic));
    } else if constexpr (BITS == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(at);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // 2^23 + k as f32 bits, minus 2^23: exact.
            const unsigned sel = 0x7440u | i;
            float lo = __uint_as_float(__byte_perm(v.x, 0x4B000000u, sel)) - 8388608.f;
            float hi = __uint_as_float(__byte_perm(v.y, 0x4B000000u, sel)) - 8388608.f;
            p[i] = pack_bf16(lo, hi);
        }
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(at);
        p[0] = v.x; p[1] = v.y; p[2] = v.z; p[3] = v.w;
    }
}

// The offset wide_frag leaves on each code.
template <int BITS>
__device__ __forceinline__ constexpr float wide_code_offset() {
    return BITS == 4 ? 128.f : 0.f;
}

// Copies stage s of the block's weight rows into weight buffer `wb` (thread i: bytes 16·(i % 4)
// of rows i / 4 and 64 + i / 4, from `w0`, `w1`: those rows' stage 0, zeros past N) and, for
// affine weights, the `words` words holding its slice of scales or biases (threads 0..127 scales
// of row i, 128..255 biases of row i − 128, from `sg`: that row's first; the slice from g_lo on)
// into `sb`.
template <int BITS>
__device__ __forceinline__ void wide_issue(const unsigned char* w0, const unsigned char* w1, bool v0, bool v1,
                                           const aff_t* sg, bool vs, int s, int g_lo, int words,
                                           unsigned char* wb, unsigned char* sb) {
    const int tid = threadIdx.x, col = (tid & 3) * 16;
    cp_async16(wb + (tid >> 2) * WIDE_WLD + col, w0 + (long long)s * WIDE_ROWB, v0);
    cp_async16(wb + (64 + (tid >> 2)) * WIDE_WLD + col, w1 + (long long)s * WIDE_ROWB, v1);
    if constexpr (BITS != 16) {
        if (vs) {
            const unsigned* src = reinterpret_cast<const unsigned*>(reinterpret_cast<size_t>(sg + g_lo) & ~size_t(3));
            unsigned char* dst = sb + tid * WIDE_SBB;
#pragma unroll
            for (int w = 0; w < WIDE_SBW; ++w)
                if (w < words) cp_async4(dst + 4 * w, src + w);
        }
    }
}

// The weight rows of a block: shared-memory rows 0..63 are matrix rows base0 + 0..63 and rows
// 64..127 are base1 + 0..63, of which the first lim0 and lim1 exist.
struct WideRows {
    long long base0, base1;
    int lim0, lim1;
};

// Folds the group at index gi of a stage's slice (from group g_lo on) into acc for every tile:
// the scales and biases of the lane's rows from their staged slices (srow: row gid's; row gid +
// 8's 8 rows on; the slices start on the words holding parameters ps + g_lo and pb + g_lo of the
// arrays), its inputs' sums from urows (4 a row).
template <int BITS, int MT>
__device__ __forceinline__ void wide_flush(const unsigned char* srow, const float* urows, int ps, int pb, int g_lo,
                                           int gi, float acc[1][MT][4], float part[1][MT][4]) {
    const int t = threadIdx.x & 3;
    const int os = (ps + g_lo) & (WIDE_PPW - 1), ob = (pb + g_lo) & (WIDE_PPW - 1);
    constexpr int BIAS = 128 * WIDE_SBB / sizeof(aff_t);
    float sc[1][2], bi[1][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const aff_t* row = reinterpret_cast<const aff_t*>(srow + 8 * h * WIDE_SBB);
        sc[0][h] = aff_scale(row[os + gi]);
        bi[0][h] = aff_bias(row[BIAS + ob + gi], sc[0][h]) - wide_code_offset<BITS>() * sc[0][h];
    }
#pragma unroll
    for (int j = 0; j < MT; ++j) {
        const float* su = &urows[(j * 8 + 2 * t) * 4 + gi];
        flush_tile<1>(sc, bi, su[0], su[4], j, acc, part);
    }
}

// One block's products: its 128 weight rows (`rw`; W, S, Bs at the matrix) over stages
// [s0, s1) against the staged inputs (`stg`, `sums`: wide_stage_rows's) of rows src[i] for its
// input i < 8·MT (−1: absent, zeros), MT tiles of 8 (no work for tiles past MT), into acc (mma C
// layout: warp w has shared rows 16w + gid, 16w + gid + 8). With `wait`, the PDL wait comes
// after the first stages' weight copies.
template <int BITS, int MT, bool G16>
__device__ void wide_core(const void* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ Bs,
                          const unsigned* stg, const float* sums, const int* src, WideRows rw, int K, int G,
                          int s0, int s1, bool wait, float acc[1][MT][4]) {
    using WS = Wide<BITS, MT>;
    constexpr int KST = WS::KST, SUB = WS::SUB, XW = WS::XW, P = WS::P;
    extern __shared__ __align__(16) unsigned char wide_smem[];
    const int tid = threadIdx.x, lane = tid & 31, gid = lane >> 2, t = lane & 3, warp = tid >> 5;
    // Groups: G = 2^gshift inputs, 2^cshift chunks; a stage holds `per` groups' scales from
    // g_lo = s·KST / G on (one when a group spans stages).
    const int gshift = __ffs(G) - 1, cshift = gshift - 5;
    const int per = KST >= G ? KST >> gshift : 1;
    const int KG = K >> gshift, KC = K >> 5, KS = K / KST;
    // This thread's weight copies: rows tid / 4 of each run, scales or biases of shared row
    // tid % 128.
    const long long row_bytes = (long long)K * BITS / 8;
    const int ra = tid >> 2, rs = tid & 127, rh = rs >> 6, ri = rs & 63;
    const unsigned char* w0 = reinterpret_cast<const unsigned char*>(W) + (rw.base0 + ra) * row_bytes + (tid & 3) * 16;
    const unsigned char* w1 = reinterpret_cast<const unsigned char*>(W) + (rw.base1 + ra) * row_bytes + (tid & 3) * 16;
    const aff_t* ssrc = (tid < 128 ? S : Bs) + ((rh ? rw.base1 : rw.base0) + ri) * KG;
    const bool wv0 = ra < rw.lim0, wv1 = ra < rw.lim1, sv = ri < (rh ? rw.lim1 : rw.lim0);
    // A slice starts on a word but, for 16-bit parameters, for one when its first index is odd:
    // row·KG is even (K % 256 == 0), so that is the array's own offset (ps, pb: in parameters,
    // within its word) plus g_lo. f32 ones start on words (ps = pb = 0, and so the offsets below).
    const int ps = reinterpret_cast<size_t>(S) / sizeof(aff_t) & (WIDE_PPW - 1);
    const int pb = reinterpret_cast<size_t>(Bs) / sizeof(aff_t) & (WIDE_PPW - 1);
    const int pw = tid < 128 ? ps : pb;
    // This thread's input copies: 16-byte pieces idx = tid + 256m of the stage's 8·MT rows ×
    // SUB chunks (row idx / 8·SUB, chunk idx / 8 % SUB, quarter-chunk idx % 8), as word offsets
    // into stg at stage 0 (−1: zero fill) and into a buffer's inputs; threads i < 8·MT copy
    // input i's group sums.
    constexpr int PIECES = 8 * MT * SUB * 8, PER = (PIECES + 255) / 256;
    const unsigned* xp[PER];
    int xd[PER];
    bool xv[PER];
#pragma unroll
    for (int m = 0; m < PER; ++m) {
        const int idx = tid + 256 * m, i = idx / (8 * SUB), u = idx / 8 % SUB, qc = idx & 7;
        const int r = idx < PIECES ? src[i] : -1;
        xv[m] = r >= 0;
        xp[m] = stg + (r < 0 ? 0 : (long long)r * KC * 32 + 32 * u + 4 * qc);
        xd[m] = idx < PIECES ? i * XW + 32 * u + 4 * qc : -1;
    }
    const int urow = tid < 8 * MT ? src[tid] : -1;
    const float* up = sums + (urow < 0 ? 0 : (long long)urow * KS * 4);
    auto buffer = [&](int b) { return wide_smem + b * WS::STAGE; };
    auto issue_w = [&](int s, int b) {
        if (s < s1) {
            const int g_lo = (s * KST) >> gshift;
            const int words = (((pw + g_lo) & (WIDE_PPW - 1)) + per + WIDE_PPW - 1) / WIDE_PPW;
            wide_issue<BITS>(w0, w1, wv0, wv1, ssrc, sv, s, g_lo, words, buffer(b), buffer(b) + WS::W_BYTES);
        }
    };
    auto issue_x = [&](int s, int b) {
        if (s >= s1) return;
        unsigned* xb = reinterpret_cast<unsigned*>(buffer(b) + WS::W_BYTES + WS::S_BYTES);
#pragma unroll
        for (int m = 0; m < PER; ++m)
            if (xd[m] >= 0) cp_async16(xb + xd[m], xp[m] + (xv[m] ? s * SUB * 32 : 0), xv[m]);
        if (BITS != 16 && tid < 8 * MT) {
            float* ub = reinterpret_cast<float*>(buffer(b) + WS::W_BYTES + WS::S_BYTES + WS::X_BYTES);
            cp_async16(ub + 4 * tid, up + (urow < 0 ? 0 : 4 * s), urow >= 0);
        }
    };
    for (int i = 0; i < P - 1; ++i) {
        issue_w(s0 + i, i);
        cp_async_commit();
    }
    if (wait) pdl_entry();
    for (int i = 0; i < P - 1; ++i) issue_x(s0 + i, i);
    cp_async_commit();

    float part[1][MT][4];
    zero_frags<1>(acc, part);
    for (int s = s0, buf = 0; s < s1; ++s, buf = buf == P - 1 ? 0 : buf + 1) {
        // Stage s's copies (this thread's) are done; after the barrier everyone's are, and
        // everyone is past stage s − 1, whose buffers take stage s + P − 1. The first stage
        // waits for every copy so far (its inputs came after the later stages' weights).
        if (s == s0) cp_async_wait_group<0>();
        else cp_async_wait_group<P - 2>();
        __syncthreads();
        {
            const int nb = buf == 0 ? P - 1 : buf - 1;
            issue_w(s + P - 1, nb);
            issue_x(s + P - 1, nb);
            cp_async_commit();
        }
        const int g_lo = (s * KST) >> gshift;
        unsigned char* base = buffer(buf);
        const unsigned char* wrow = base + (warp * 16 + gid) * WIDE_WLD + t * (G16 ? 4 : BITS);
        const unsigned char* srow = base + WS::W_BYTES + (warp * 16 + gid) * WIDE_SBB;
        const unsigned* xrow = reinterpret_cast<const unsigned*>(base + WS::W_BYTES + WS::S_BYTES) + gid * XW + 8 * t;
        const float* urows = reinterpret_cast<const float*>(base + WS::W_BYTES + WS::S_BYTES + WS::X_BYTES);
#pragma unroll
        for (int u = 0; u < SUB; ++u) {
            unsigned a[2][4];
#pragma unroll
            for (int h = 0; h < 2; ++h) wide_frag<BITS, G16>(wrow + 8 * h * WIDE_WLD + u * 4 * BITS, a[h]);
            // Per k16 step, every tile's hi products, then its lo products: independent
            // accumulators back to back.
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                uint4 v[MT];
#pragma unroll
                for (int j = 0; j < MT; ++j)
                    v[j] = *reinterpret_cast<const uint4*>(&xrow[j * 8 * XW + 32 * u + 4 * st]);
#pragma unroll
                for (int lo = 0; lo < 2; ++lo)
#pragma unroll
                    for (int j = 0; j < MT; ++j)
                        mma_bf16(BITS == 16 ? acc[0][j] : part[0][j], a[0][2 * st], a[1][2 * st],
                                 a[0][2 * st + 1], a[1][2 * st + 1], lo ? v[j].z : v[j].x,
                                 lo ? v[j].w : v[j].y);
                // Groups of 16: the step's group is the stage's 2u + st.
                if constexpr (G16) wide_flush<BITS, MT>(srow, urows, ps, pb, g_lo, 2 * u + st, acc, part);
            }
            if constexpr (BITS != 16 && !G16) {
                // The group ends with this chunk: its scales sit at (slice offset + its index in
                // the stage's slice) parameters into each row's staged slice, its inputs' sums at
                // that index of their 4.
                if (((s * SUB + u + 1) & ((1 << cshift) - 1)) == 0)
                    wide_flush<BITS, MT>(srow, urows, ps, pb, g_lo, KST >= G ? u >> cshift : 0, acc, part);
            }
        }
    }
}

// The block's weight rows: 128 outputs from rblk, or for SwiGLU 64 outputs from rblk64 as their
// 64 gate rows then their 64 up rows (`[gate | up]`, N outputs each), at matrix row offset `off`.
__device__ __forceinline__ WideRows wide_rows(bool swiglu, long long off, int N) {
    if (swiglu) {
        const int r = blockIdx.y * 64, lim = max(0, min(64, N - r));
        return {off + r, off + N + r, lim, lim};
    }
    const int r = blockIdx.y * 128;
    return {off + r, off + r + 64, max(0, min(64, N - r)), max(0, min(64, N - r - 64))};
}

// Writes the block's outputs: y[out_row(b)·N + n] (out_rows null: b0 + b) for the block's
// outputs n and inputs b < nb, or for SwiGLU h = silu(gate)·up, the up rows' sums (warps 4..7)
// passed to the gate rows' warps (0..3) through shared memory.
template <int MT>
__device__ __forceinline__ void wide_store(float acc[1][MT][4], bool swiglu, float* y, int N, int nb,
                                           const int* out_rows, int b0, const float* bias) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (!swiglu) {
        store_frags<1>(acc, y, N, blockIdx.y * 128 + warp * 16, nb, out_rows, b0, bias);
        return;
    }
    extern __shared__ __align__(16) unsigned char wide_smem[];
    float* xch = reinterpret_cast<float*>(wide_smem);  // [4 warps][MT·4][32]
    __syncthreads();
    if (warp >= 4)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) xch[((warp - 4) * MT * 4 + j * 4 + e) * 32 + lane] = acc[0][j][e];
    __syncthreads();
    if (warp >= 4) return;
    float gu[2][MT][4];
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            gu[0][j][e] = acc[0][j][e];
            gu[1][j][e] = xch[(warp * MT * 4 + j * 4 + e) * 32 + lane];
        }
    store_frags<2>(gu, y, N, blockIdx.y * 64 + warp * 16, nb, out_rows, b0, nullptr);
}

// Dense form: block (x, y, z) takes inputs 32x + 0..32 and stages [z·spb, (z + 1)·spb); with
// ks > 1 the partial sums go to part [ks, B, sets·N] (gate at n, up at N + n).
template <int BITS, int MT, bool G16>
__device__ void wide_dense(const void* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ Bs,
                           const unsigned* stg, const float* sums, const int* src, float* y, float* part_out, int N,
                           int K, int G, int Bn, const float* __restrict__ bias, int spb, bool swiglu) {
    const int b0 = blockIdx.x * 32, nb = min(32, Bn - b0);
    const int s0 = blockIdx.z * spb, s1 = min(s0 + spb, K / Wide<BITS, MT>::KST);
    const WideRows rw = wide_rows(swiglu, 0, N);
    float acc[1][MT][4];
    wide_core<BITS, MT, G16>(W, S, Bs, stg, sums, src, rw, K, G, s0, s1, true, acc);
    if (gridDim.z == 1) {
        wide_store<MT>(acc, swiglu, y, N, nb, nullptr, b0, bias);
        return;
    }
    const int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
    const int sets = swiglu ? 2 : 1, run = warp >> 2, i0 = (warp & 3) * 16;
    float* out = part_out + (long long)blockIdx.z * Bn * sets * N;
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = i0 + gid + (e >= 2 ? 8 : 0), b = j * 8 + 2 * t + (e & 1);
            const long long n = run ? rw.base1 + i : rw.base0 + i;
            if (i < (run ? rw.lim1 : rw.lim0) && b < nb) out[(long long)(b0 + b) * sets * N + n] = acc[0][j][e];
        }
}

// The dense form compiled for each count of 8-row tiles, so that small batches issue no
// instructions for absent rows.
template <int BITS, bool G16 = false>
__device__ void mma_wide_t(const void* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ Bs,
                           const unsigned* stg, const float* sums, float* y, float* part_out, int N, int K, int G,
                           int Bn, const float* __restrict__ bias, int spb, bool swiglu) {
    __shared__ int src[32];
    const int b0 = blockIdx.x * 32, nb = min(32, Bn - b0);
    if (threadIdx.x < 32) src[threadIdx.x] = (int)threadIdx.x < nb ? b0 + threadIdx.x : -1;
    __syncthreads();
    switch ((nb + 7) >> 3) {
    case 1: wide_dense<BITS, 1, G16>(W, S, Bs, stg, sums, src, y, part_out, N, K, G, Bn, bias, spb, swiglu); break;
    case 2: wide_dense<BITS, 2, G16>(W, S, Bs, stg, sums, src, y, part_out, N, K, G, Bn, bias, spb, swiglu); break;
    case 3: wide_dense<BITS, 3, G16>(W, S, Bs, stg, sums, src, y, part_out, N, K, G, Bn, bias, spb, swiglu); break;
    default: wide_dense<BITS, 4, G16>(W, S, Bs, stg, sums, src, y, part_out, N, K, G, Bn, bias, spb, swiglu); break;
    }
}

// One tile of the grouped form, compiled for each count of 8-row tiles.
template <int BITS, int MT, bool G16>
__device__ void gwide_tile(const void* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ Bs,
                           const unsigned* stg, const float* sums, const int* src, WideRows rw, int K, int G,
                           float* y, int N, int nb, const int* pair, bool swiglu) {
    float acc[1][MT][4];
    wide_core<BITS, MT, G16>(W, S, Bs, stg, sums, src, rw, K, G, 0, K / Wide<BITS, MT>::KST, false, acc);
    wide_store<MT>(acc, swiglu, y, N, nb, pair, 0, nullptr);
}

// Grouped form (MoE decode batches, pairs sorted by expert by `moe_group`): block x takes tiles
// blockIdx.x, blockIdx.x + gridDim.x, … of `tiles` (int3: expert e, first index f into `order`,
// count ≤ 32), each over the whole K: its inputs are pairs p = order[f + i], staged input row
// p / x_div, the weights expert e's of a stack [E, N, K] ([E, 2I, K] for SwiGLU), output row p
// of y. Tiles of at most 8·MTMAX pairs (the host's tile size): blocks compiled for one tile
// (MTMAX 1) need 59 registers, so three fit a multiprocessor where the full form's 128 fit two.
template <int BITS, int MTMAX, bool G16 = false>
__device__ void mma_gwide_t(const void* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ Bs,
                            const unsigned* stg, const float* sums, float* y, int N, int K, int G, const int* tiles,
                            const int* n_tiles, const int* order, int x_div, bool swiglu) {
    __shared__ int pair[32], src[32];
    pdl_entry();
    const int count = n_tiles[0];
    for (int ti = blockIdx.x; ti < count; ti += gridDim.x) {
        const int e = tiles[3 * ti], f = tiles[3 * ti + 1], nb = tiles[3 * ti + 2];
        // The tile before is done with shared memory.
        __syncthreads();
        if (threadIdx.x < 32) {
            const int p = threadIdx.x < nb ? order[f + threadIdx.x] : 0;
            pair[threadIdx.x] = p;
            src[threadIdx.x] = threadIdx.x < nb ? p / x_div : -1;
        }
        __syncthreads();
        const WideRows rw = wide_rows(swiglu, (long long)e * (swiglu ? 2 : 1) * N, N);
        if constexpr (MTMAX == 1) {
            gwide_tile<BITS, 1, G16>(W, S, Bs, stg, sums, src, rw, K, G, y, N, nb, pair, swiglu);
        } else {
            switch ((nb + 7) >> 3) {
            case 1: gwide_tile<BITS, 1, G16>(W, S, Bs, stg, sums, src, rw, K, G, y, N, nb, pair, swiglu); break;
            case 2: gwide_tile<BITS, 2, G16>(W, S, Bs, stg, sums, src, rw, K, G, y, N, nb, pair, swiglu); break;
            case 3: gwide_tile<BITS, 3, G16>(W, S, Bs, stg, sums, src, rw, K, G, y, N, nb, pair, swiglu); break;
            default: gwide_tile<BITS, 4, G16>(W, S, Bs, stg, sums, src, rw, K, G, y, N, nb, pair, swiglu); break;
            }
        }
    }
}

// The affine dense entries (suffix TAIL): 8-bit codes where EIGHT holds, else 4-bit, with
// groups of 16 when G16.
#define WIDE_AFFINE(TAIL, EIGHT, G16)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 2) mma_wide_rows_affine##TAIL(                          \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,             \
        const unsigned* stg, const float* sums, float* y, float* part, int N, int K, int G, int bits, int Bn,  \
        const float* __restrict__ bias, int spb) {                                                            \
        if (EIGHT) mma_wide_t<8, G16>(W, S, B, stg, sums, y, part, N, K, G, Bn, bias, spb, false);            \
        else mma_wide_t<4>(W, S, B, stg, sums, y, part, N, K, G, Bn, bias, spb, false);                       \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, 2) mma_wide_swiglu_affine##TAIL(                        \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,             \
        const unsigned* stg, const float* sums, float* h, float* part, int I, int K, int G, int bits, int Bn,  \
        int spb) {                                                                                            \
        if (EIGHT) mma_wide_t<8, G16>(W, S, B, stg, sums, h, part, I, K, G, Bn, nullptr, spb, true);          \
        else mma_wide_t<4>(W, S, B, stg, sums, h, part, I, K, G, Bn, nullptr, spb, true);                     \
    }

extern "C" __global__ void __launch_bounds__(256, 2) mma_wide_rows_bf16(const bf16_t* __restrict__ W, const unsigned* stg,
                                                                     const float* sums, float* y, float* part, int N, int K, int Bn,
                                                                     const float* __restrict__ bias, int spb) {
    mma_wide_t<16>(W, nullptr, nullptr, stg, sums, y, part, N, K, 32, Bn, bias, spb, false);
}

extern "C" __global__ void __launch_bounds__(256, 2) mma_wide_swiglu_bf16(const bf16_t* __restrict__ W, const unsigned* stg,
                                                                       const float* sums, float* h, float* part, int I, int K, int Bn, int spb) {
    mma_wide_t<16>(W, nullptr, nullptr, stg, sums, h, part, I, K, 32, Bn, nullptr, spb, true);
}

WIDE_AFFINE(, bits == 8, false)

// The grouped affine entries (TAIL, EIGHT, G16 as WIDE_AFFINE's), tiles of up to 8·MTMAX pairs
// and BLOCKS blocks a multiprocessor.
#define GWIDE_AFFINE(SUFFIX, TAIL, MTMAX, BLOCKS, EIGHT, G16)                                                  \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) mma_gwide_rows_affine##SUFFIX##TAIL(            \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,             \
        const unsigned* stg, const float* sums, float* y, int N, int K, int G, int bits, const int* tiles,    \
        const int* n_tiles, const int* order, int x_div) {                                                    \
        if (EIGHT) mma_gwide_t<8, MTMAX, G16>(W, S, B, stg, sums, y, N, K, G, tiles, n_tiles, order, x_div, false); \
        else mma_gwide_t<4, MTMAX>(W, S, B, stg, sums, y, N, K, G, tiles, n_tiles, order, x_div, false);     \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) mma_gwide_swiglu_affine##SUFFIX##TAIL(          \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,             \
        const unsigned* stg, const float* sums, float* h, int I, int K, int G, int bits, const int* tiles,    \
        const int* n_tiles, const int* order, int x_div) {                                                    \
        if (EIGHT) mma_gwide_t<8, MTMAX, G16>(W, S, B, stg, sums, h, I, K, G, tiles, n_tiles, order, x_div, true); \
        else mma_gwide_t<4, MTMAX>(W, S, B, stg, sums, h, I, K, G, tiles, n_tiles, order, x_div, true);      \
    }

// The grouped entry points: tiles of up to 32 pairs (two blocks a multiprocessor), and `_t1`
// for tiles of up to 8 (three).
#define GWIDE_ENTRIES(SUFFIX, MTMAX, BLOCKS)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) mma_gwide_rows_bf16##SUFFIX(                    \
        const bf16_t* __restrict__ W, const unsigned* stg, const float* sums, float* y, int N, int K,         \
        const int* tiles, const int* n_tiles, const int* order, int x_div) {                                  \
        mma_gwide_t<16, MTMAX>(W, nullptr, nullptr, stg, sums, y, N, K, 32, tiles, n_tiles, order, x_div,     \
                               false);                                                                        \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) mma_gwide_swiglu_bf16##SUFFIX(                  \
        const bf16_t* __restrict__ W, const unsigned* stg, const float* sums, float* h, int I, int K,         \
        const int* tiles, const int* n_tiles, const int* order, int x_div) {                                  \
        mma_gwide_t<16, MTMAX>(W, nullptr, nullptr, stg, sums, h, I, K, 32, tiles, n_tiles, order, x_div,     \
                               true);                                                                         \
    }                                                                                                         \
    GWIDE_AFFINE(SUFFIX, , MTMAX, BLOCKS, bits == 8, false)

GWIDE_ENTRIES(, 4, 2)
GWIDE_ENTRIES(_t1, 1, 3)

#if AFFINE_G16
// The affine entries for 8-bit codes in groups of 16 (mma_frag.cuh): the same arguments (bits 8,
// G 16).
WIDE_AFFINE(_g16, true, true)
GWIDE_AFFINE(, _g16, 4, 2, true, true)
GWIDE_AFFINE(_t1, _g16, 1, 3, true, true)
#endif

// wide_sum: y[b, n] = Σ_z part[z, b, n] (+ bias[n]) over the ks partial sums of the wide form,
// in order of z; SwiGLU (sets 2): h[b, n] = silu(Σ gate)·Σ up, gate at n, up at N + n of each
// partial row. grid (ceil(N / 256), B), block 256.
extern "C" __global__ void wide_sum(const float* part, float* y, int N, int Bn, int ks, int sets,
                                    const float* __restrict__ bias) {
    pdl_entry();
    const int n = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
    if (n >= N) return;
    const long long stride = (long long)Bn * sets * N;
    const float* p = part + (long long)b * sets * N + n;
    float g = 0.f, u = 0.f;
    for (int z = 0; z < ks; ++z) {
        g += p[z * stride];
        if (sets == 2) u += p[z * stride + N];
    }
    y[(long long)b * N + n] = sets == 2 ? silu_f(g) * u : g + (bias ? bias[n] : 0.f);
}
