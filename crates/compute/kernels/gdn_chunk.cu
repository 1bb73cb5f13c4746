// Gated delta rule, chunked forward for prefill (chunks of 64 tokens), on tensor cores
// (mma.sync m16n8k16 bf16 with f32 accumulation; the state is kept in f32). The math is the
// chunked form of crates/compute/src/cpu/gdn.rs (gdn_chunked, the CPU twin).
//
// Inputs: q, k bf16 [T, Hk, Dk]; v bf16 [T, Hv, Dv]; g (log decay ≤ 0) and beta f32 [T, Hv];
// state f32 [Hv, Dk, Dv] (read as the initial state, overwritten with the final one; the layout of
// gdn_step in gdn.cu); out f32 [T, Hv, Dv]. Value head h reads key head h / (Hv / Hk).
// Dk ≤ 128 and Dv ≤ 128 (tiles are zero padded to 128). norm_qk ≠ 0: q and k are l2-normalised
// here (x / sqrt(Σx² + 1e-6), as gdn_step) and q is scaled by 1/sqrt(Dk); norm_qk = 0: they
// arrive normalised and scaled. The normalisation never touches the q/k tiles: its row factors
// rq_i, rk_i are folded into the 64×64 matrices and the per-row coefficients below.
//
// Per chunk (G = cumulative g inside the chunk, S the state entering it, hats = normalised):
//   A_ij = β_i k̂_i·k̂_j e^{G_i−G_j} (j < i),  T = (I + A)⁻¹,
//   P_ij = q̂_i·k̂_j e^{G_i−G_j} (j ≤ i),
//   X = K S,  Y_i = β_i (V_i − rk_i e^{G_i} X_i),  V' = T Y   (= U − W S of the CPU twin),
//   O_i = rq_i e^{G_i} (Q S)_i + (P V')_i,
//   S ← e^{G_last} S + Kᵀ diag(rk_j e^{G_last−G_j}) V'.
// Rows past T in the last chunk are zero (k, q, v, β = 0, g = 0), so they change nothing.
//
// Workspace (written by gdn_chunk_prep, read by gdn_chunk_state*), NC = ceil(T/64):
//   tinv  bf16 [Hv, NC, 64, 64]  T (unit lower triangular, zeros above)
//   pmat  bf16 [Hv, NC, 64, 64]  P (zeros above the diagonal)
//   coef  f32x4 [Hv, NC·64]      (rq_i e^{G_i}, rk_i e^{G_i}, β_i, rk_i e^{G_last−G_i})
//   decay f32 [Hv, NC]           e^{G_last}
//
// gdn_chunk_prep: grid (Hv, NC), block 256 (8 warps), dynamic shared memory GDN_PREP_SMEM bytes.
//   Loads the chunk's k and q tiles, computes the row norms, K Kᵀ and Q Kᵀ on tensor cores (warp
//   w: rows 16·(w%4).., columns 32·(w/4)..) and the cumulative gates, then T = (I + A)⁻¹ in f32
//   by 32×32 blocks: the diagonal ones by forward substitution (one thread per column), the one
//   below as T₂₁ = −T₂₂ A₂₁ T₁₁.
// gdn_chunk_state32 / gdn_chunk_state64 (BV = 32 / 64): grid Hv·ceil(Dv/BV) (block b: head
//   b / ceil(Dv/BV), value columns BV·(b % ceil(Dv/BV))..), block 512 (16 warps), dynamic shared
//   memory GDN_STATE_SMEM(BV, NS) bytes (NS = 3 stages for BV = 32, 2 for 64). Walks the chunks
//   in order with the tiles of the next NS − 1 chunks (q, k, the v columns, T, P, coef) in flight
//   by cp.async into the other stages while the current one is computed. The block's state S[0..128, BV] stays in registers as mma accumulators (warp w:
//   rows 16·(w%8).., columns (BV/2)·(w/8)..), with a bf16 copy in shared memory as the B
//   operand. Per chunk, three phases between barriers: warps 0-7 X and Y, warps 8-15 Q S (each
//   rows 16·(w%4).., columns (BV/2)·((w/4)%2)..); all V' = T Y; warps 8-15 add P V' and write
//   out while all update their state tiles.

#define GC 64            // chunk length
#define GDK 128          // key dim tile (Dk zero padded)
#define LDK (GDK + 8)    // shared row stride (bf16) of q/k tiles: 272 bytes, conflict-free ldmatrix
#define LDC (GC + 8)     // shared row stride of 64×64 tiles
#define LDA (GC + 4)     // f32 A of the inverse (rows 16-byte aligned for float4 reads)

extern __shared__ __align__(16) unsigned char gdn_smem[];

// Fragment loaders (ldmatrix). An accumulator c[4] of a 16×8 tile holds (row gid, cols 2·tig,
// 2·tig+1) in c[0..2] and row gid+8 in c[2..4], gid = lane/4, tig = lane%4.
// A 16×16 at (r0, k0) of a row-major tile.
__device__ __forceinline__ void frag_a(unsigned (&a)[4], const bf16_t* s, int ld, int r0, int k0) {
    int l = threadIdx.x & 31;
    ldsm_x4(a, s + (r0 + (l & 15)) * ld + k0 + (l >> 4) * 8);
}
// A 16×16 at (m0, k0) where A(m, k) is stored at s[k·ld + m].
__device__ __forceinline__ void frag_a_t(unsigned (&a)[4], const bf16_t* s, int ld, int m0, int k0) {
    int l = threadIdx.x & 31, j = l >> 3;
    ldsm_x4_t(a, s + (k0 + (l & 7) + (j >> 1) * 8) * ld + m0 + (j & 1) * 8);
}
// B for the two 8-column tiles n0, n0+8 over k0..k0+15, B(k, n) stored at s[k·ld + n]:
// b[0], b[1] for tile n0, b[2], b[3] for tile n0+8.
__device__ __forceinline__ void frag_b_kn(unsigned (&b)[4], const bf16_t* s, int ld, int k0, int n0) {
    int l = threadIdx.x & 31, j = l >> 3;
    ldsm_x4_t(b, s + (k0 + (l & 7) + (j & 1) * 8) * ld + n0 + (j >> 1) * 8);
}
// B for the single 8-column tile n0 over k0..k0+15, B(k, n) stored at s[k·ld + n].
__device__ __forceinline__ void frag_b_kn_x2(unsigned (&b)[2], const bf16_t* s, int ld, int k0, int n0) {
    int l = threadIdx.x & 31;
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b[0]), "=r"(b[1])
                 : "r"(smem_u32(s + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0)));
}
// As frag_b_kn with B(k, n) stored at s[n·ld + k].
__device__ __forceinline__ void frag_b_nk(unsigned (&b)[4], const bf16_t* s, int ld, int k0, int n0) {
    int l = threadIdx.x & 31, j = l >> 3;
    ldsm_x4(b, s + (n0 + (l & 7) + (j >> 1) * 8) * ld + k0 + (j & 1) * 8);
}

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// Fill 64 rows × COLS columns of the shared tile dst (row stride ld) from src (row stride `stride`
// elements); rows ≥ rows and columns ≥ cols become zero. vec: cols == COLS, src and stride
// 16-byte aligned, so whole rows go by cp.async (the caller commits and waits); otherwise
// element by element with plain loads.
template <int COLS>
__device__ __forceinline__ void load_tile(bf16_t* dst, int ld, const bf16_t* src, long long stride, int rows,
                                          int cols, bool vec) {
    if (vec) {
        constexpr int CH = COLS / 8;
        for (int i = threadIdx.x; i < GC * CH; i += blockDim.x) {
            int r = i / CH, c = (i % CH) * 8;
            bool ok = r < rows;
            cp_async16(dst + r * ld + c, src + (ok ? r * stride + c : 0), ok);
        }
    } else {
        for (int i = threadIdx.x; i < GC * COLS; i += blockDim.x) {
            int r = i / COLS, c = i % COLS;
            dst[r * ld + c] = (r < rows && c < cols) ? src[r * stride + c] : (bf16_t)0;
        }
    }
}

// Column j of the diagonal block T[R0..R0+32, R0..R0+32] of T = (I + A)⁻¹ (R0 ≤ j < R0 + 32):
// x_i = δ_ij − Σ_{R0≤m<i} A_im x_m, with A's rows read as broadcast float4s (A: f32, row stride
// LDA) and x in registers (fully unrolled; two partial sums shorten the dependency chains).
// Writes x to Ts[i·LDA + j] (f32) and to tc[i·64] (bf16, tc pointing at column j).
template <int R0>
__device__ __forceinline__ void solve_diag_column(const float* As, float* Ts, bf16_t* tc, int j) {
    float x[32];
#pragma unroll
    for (int i = R0; i < R0 + 32; ++i) {
        const float4* ar = (const float4*)(As + i * LDA + R0);
        float s0 = i == j ? 1.f : 0.f, s1 = 0.f;
#pragma unroll
        for (int m4 = 0; R0 + 4 * m4 < i; ++m4) {
            float4 a = ar[m4];
            int m = R0 + 4 * m4;
            s0 = fmaf(-a.x, x[m - R0], s0);
            if (m + 1 < i) s1 = fmaf(-a.y, x[m + 1 - R0], s1);
            if (m + 2 < i) s0 = fmaf(-a.z, x[m + 2 - R0], s0);
            if (m + 3 < i) s1 = fmaf(-a.w, x[m + 3 - R0], s1);
        }
        x[i - R0] = s0 + s1;
        Ts[i * LDA + j] = x[i - R0];
        tc[i * GC] = f32_to_bf16_rn(x[i - R0]);
    }
}

// The f32 A and T (64·68 floats each) reuse the q/k tiles' space once K Kᵀ and Q Kᵀ are done;
// then g, β, the row factors, and the 32×32 product A₂₁T₁₁ (row stride 33).
#define GDN_PREP_SMEM (2 * GC * LDK * 2 + 4 * GC * 4 + 32 * 33 * 4)

extern "C" __global__ void __launch_bounds__(256, 3) gdn_chunk_prep(
    const bf16_t* q, const bf16_t* k, const float* g,
    const float* beta, bf16_t* __restrict__ tinv, bf16_t* __restrict__ pmat,
    float4* __restrict__ coef, float* __restrict__ decay, int T, int Hk, int Hv, int Dk, int norm_qk) {
    pdl_entry();
    bf16_t* Ks = (bf16_t*)gdn_smem;     // [64][LDK]
    bf16_t* Qs = Ks + GC * LDK;         // [64][LDK]
    float* As = (float*)gdn_smem;       // [64][LDA] A (strictly lower), over Ks/Qs
    float* Ts = As + GC * LDA;          // [64][LDA] T's diagonal 32×32 blocks, over Ks/Qs
    float* Gs = (float*)(Qs + GC * LDK);  // cumulative g · log2(e)
    float* Bs = Gs + GC;                // β
    float* Rk = Bs + GC;                // k row factors
    float* Rq = Rk + GC;                // q row factors
    float* Ms = Rq + GC;                // [32][33] A₂₁ T₁₁

    const int h = blockIdx.x, c = blockIdx.y, NC = gridDim.y;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    const int kh = h / (Hv / Hk), t0 = c * GC, L = min(GC, T - t0);
    const long long kst = (long long)Hk * Dk;
    const bf16_t* kp = k + (long long)t0 * kst + (long long)kh * Dk;
    const bf16_t* qp = q + (long long)t0 * kst + (long long)kh * Dk;
    bool vec = Dk == GDK && (kst % 8) == 0 && aligned16(kp) && aligned16(qp);
    load_tile<GDK>(Ks, LDK, kp, kst, L, Dk, vec);
    load_tile<GDK>(Qs, LDK, qp, kst, L, Dk, vec);
    cp_async_commit();

    // Cumulative gates and β: warp 0, two tokens per lane.
    if (w == 0) {
        int i0 = 2 * lane, i1 = i0 + 1;
        float g0 = i0 < L ? g[(long long)(t0 + i0) * Hv + h] : 0.f;
        float g1 = i1 < L ? g[(long long)(t0 + i1) * Hv + h] : 0.f;
        float s = g0 + g1;
        for (int o = 1; o < 32; o <<= 1) {
            float n = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += n;
        }
        // Kept in log2 units: every exponential below is one exp2f.
        Gs[i0] = (s - g1) * 1.44269504f;
        Gs[i1] = s * 1.44269504f;
        Bs[i0] = i0 < L ? beta[(long long)(t0 + i0) * Hv + h] : 0.f;
        Bs[i1] = i1 < L ? beta[(long long)(t0 + i1) * Hv + h] : 0.f;
    }
    cp_async_wait_all();
    __syncthreads();

    // Row factors: two threads per row of k (threads 0-127) or q (128-255), 64 columns each.
    {
        int which = tid >> 7, r = (tid >> 1) & 63, half = tid & 1;
        const bf16_t* row = (which ? Qs : Ks) + r * LDK + half * 64;
        float ss = 0.f;
#pragma unroll
        for (int c8 = 0; c8 < 64; c8 += 8) {
            uint4 x = *(const uint4*)(row + c8);
            unsigned u[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float a = bf16lo(u[e]), b = bf16hi(u[e]);
                ss = fmaf(a, a, fmaf(b, b, ss));
            }
        }
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        float f = norm_qk ? rsqrtf(ss + 1e-6f) * (which ? rsqrtf((float)Dk) : 1.f) : 1.f;
        if (half == 0) (which ? Rq : Rk)[r] = r < L ? f : 0.f;
    }

    // K Kᵀ and Q Kᵀ: warp w, rows 16·rt.., columns 32·ch.. (16-column pairs above the diagonal skipped).
    const int rt = w & 3, ch = w >> 2;
    float kk[4][4], qk[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[j][e] = qk[j][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < GDK / 16; ++ks) {
        unsigned ak[4], aq[4];
        frag_a(ak, Ks, LDK, 16 * rt, 16 * ks);
        frag_a(aq, Qs, LDK, 16 * rt, 16 * ks);
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            if (32 * ch + 16 * p > 16 * rt + 15) continue;
            unsigned b[4];
            frag_b_nk(b, Ks, LDK, 16 * ks, 32 * ch + 16 * p);
            mma_bf16(kk[2 * p], ak, b[0], b[1]);
            mma_bf16(kk[2 * p + 1], ak, b[2], b[3]);
            mma_bf16(qk[2 * p], aq, b[0], b[1]);
            mma_bf16(qk[2 * p + 1], aq, b[2], b[3]);
        }
    }
    __syncthreads();  // Gs, Bs, Rk, Rq visible; Ks, Qs free for As, Ts

    bf16_t* pc = pmat + ((long long)h * NC + c) * GC * GC;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            int i = 16 * rt + gid + 8 * hf;
            int j0 = 32 * ch + 8 * j + 2 * tig;
            float av[2], pv[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int jj = j0 + e;
                float d = jj <= i ? exp2f(Gs[i] - Gs[jj]) : 0.f;
                av[e] = jj < i ? Bs[i] * Rk[i] * Rk[jj] * d * kk[j][2 * hf + e] : 0.f;
                pv[e] = jj <= i ? Rq[i] * Rk[jj] * d * qk[j][2 * hf + e] : 0.f;
                As[i * LDA + jj] = av[e];
            }
            *(unsigned*)(pc + i * GC + j0) = pack_bf16(pv[0], pv[1]);
        }
    }
    __syncthreads();

    // T = (I + A)⁻¹ in 32×32 blocks: T₁₁ and T₂₂ by forward substitution, one thread per
    // column (warps 0 and 1), then T₂₁ = −T₂₂ (A₂₁ T₁₁) by all threads; T₁₂ = 0. Threads 64-127
    // write the per-token coefficients meanwhile.
    bf16_t* tc = tinv + ((long long)h * NC + c) * GC * GC;
    if (w == 0) {
        solve_diag_column<0>(As, Ts, tc + tid, tid);
    } else if (w == 1) {
        solve_diag_column<32>(As, Ts, tc + tid, tid);
#pragma unroll
        for (int i = 0; i < 32; ++i) tc[i * GC + tid] = 0;
    } else if (tid < 2 * GC) {
        int i = tid - GC;
        float gl = Gs[GC - 1], gi = Gs[i], eg = exp2f(gi);
        coef[((long long)h * NC + c) * GC + i] =
            make_float4(Rq[i] * eg, Rk[i] * eg, Bs[i], Rk[i] * exp2f(gl - gi));
        if (i == 0) decay[(long long)h * NC + c] = exp2f(gl);
    }
    __syncthreads();
    // Thread: column cc, rows r0..r0+3 of the 32×32 blocks.
    const int cc = tid & 31, r0 = (tid >> 5) * 4;
    {
        float m[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int k4 = 0; k4 < 8; ++k4) {
            float u0 = Ts[(4 * k4) * LDA + cc], u1 = Ts[(4 * k4 + 1) * LDA + cc];
            float u2 = Ts[(4 * k4 + 2) * LDA + cc], u3 = Ts[(4 * k4 + 3) * LDA + cc];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                float4 a = *(const float4*)(As + (32 + r0 + r) * LDA + 4 * k4);
                m[r] = fmaf(a.w, u3, fmaf(a.z, u2, fmaf(a.y, u1, fmaf(a.x, u0, m[r]))));
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) Ms[(r0 + r) * 33 + cc] = m[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int i = r0 + r;  // row of T₂₂, zero right of the diagonal
        const float* t22 = Ts + (32 + i) * LDA + 32;
        float s = 0.f;
        for (int k = 0; k <= i; ++k) s = fmaf(t22[k], Ms[k * 33 + cc], s);
        tc[(32 + i) * GC + cc] = f32_to_bf16_rn(-s);
    }
}

// Shared memory of gdn_chunk_state<BV, NS>: NS stages of (q, k, v columns, T, P, coef), then the
// bf16 state copy [128][BV+8] and the Y, V', diag(ks)·V' tiles [64][BV+8].
#define GDN_STATE_THREADS 512
#define GDN_STAGE_BYTES(BV) (2 * GC * LDK * 2 + GC * ((BV) + 8) * 2 + 2 * GC * LDC * 2 + GC * 16)
#define GDN_STATE_SMEM(BV, NS) ((NS) * GDN_STAGE_BYTES(BV) + GDK * ((BV) + 8) * 2 + 3 * GC * ((BV) + 8) * 2)

template <int BV, int NS>
__device__ __forceinline__ void gdn_chunk_state(const bf16_t* q, const bf16_t* k,
                                                const bf16_t* v, const bf16_t* tinv,
                                                const bf16_t* pmat, const float4* coef,
                                                const float* decay, float* __restrict__ state,
                                                float* __restrict__ out, int T, int Hk, int Hv, int Dk, int Dv) {
    constexpr int LDV = BV + 8;
    constexpr int HB = BV / 2;   // columns of a half tile
    constexpr int NH = BV / 16;  // 8-column accumulator tiles in a half tile
    constexpr int NE = BV / 32;  // 8-column tiles per warp in V' = T Y
    const int ntiles = (Dv + BV - 1) / BV;
    const int h = blockIdx.x / ntiles, v0 = (blockIdx.x % ntiles) * BV;
    const int kh = h / (Hv / Hk), NC = (T + GC - 1) / GC;
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    const int vcols = min(BV, Dv - v0);

    // Stage c % NS holds chunk c (computed as an offset: an indexed pointer array would live in
    // local memory). Chunk c + NS − 1 is loaded while chunk c is computed.
    auto stage = [](int c) { return (bf16_t*)(gdn_smem + (c % NS) * GDN_STAGE_BYTES(BV)); };
    bf16_t* Sb = (bf16_t*)(gdn_smem + NS * GDN_STAGE_BYTES(BV));  // [128][LDV]
    bf16_t* Ys = Sb + GDK * LDV;                                 // [64][LDV]
    bf16_t* Vp = Ys + GC * LDV;                                  // [64][LDV]
    bf16_t* Vd = Vp + GC * LDV;                                  // [64][LDV]

    const long long kst = (long long)Hk * Dk, vst = (long long)Hv * Dv;
    const bool vec_qk = Dk == GDK && (kst % 8) == 0 && aligned16(q) && aligned16(k);
    const bool vec_v = vcols == BV && (Dv % 8) == 0 && aligned16(v);

    // Per-thread offsets of the 16-byte pieces this thread copies in a full chunk when every tile
    // goes by cp.async (GDN_STATE_THREADS threads): q/k rows tid/16 and tid/16 + 32, 64×64 tile
    // row tid/8, v row tid/(BV/8) for tid < 64·BV/8.
    constexpr int VCH = BV / 8;
    const int qr = tid >> 4, qc = (tid & 15) * 8, mr = tid >> 3, mc = (tid & 7) * 8;
    const int vr = tid / VCH, vc = (tid % VCH) * 8;
    const long long qoff = qr * kst + qc, voff = vr * vst + vc;
    const bool fast = vec_qk && vec_v;

    auto issue = [&](int c) {
        bf16_t* Qs = stage(c);
        bf16_t* Ks = Qs + GC * LDK;
        bf16_t* Vs = Ks + GC * LDK;
        bf16_t* Tm = Vs + GC * LDV;
        bf16_t* Pm = Tm + GC * LDC;
        float4* Cf = (float4*)(Pm + GC * LDC);
        int t0 = c * GC, L = min(GC, T - t0);
        long long ko = (long long)t0 * kst + (long long)kh * Dk;
        if (fast && L == GC) {
            const bf16_t* qp = q + ko + qoff;
            const bf16_t* kp = k + ko + qoff;
            cp_async16(Qs + qr * LDK + qc, qp, true);
            cp_async16(Qs + (qr + 32) * LDK + qc, qp + 32 * kst, true);
            cp_async16(Ks + qr * LDK + qc, kp, true);
            cp_async16(Ks + (qr + 32) * LDK + qc, kp + 32 * kst, true);
            if (tid < GC * VCH)
                cp_async16(Vs + vr * LDV + vc, v + (long long)t0 * vst + (long long)h * Dv + v0 + voff, true);
            long long mo = ((long long)h * NC + c) * GC * GC + mr * GC + mc;
            cp_async16(Tm + mr * LDC + mc, tinv + mo, true);
            cp_async16(Pm + mr * LDC + mc, pmat + mo, true);
            if (tid < GC) cp_async16(Cf + tid, coef + ((long long)h * NC + c) * GC + tid, true);
            return;
        }
        load_tile<GDK>(Qs, LDK, q + ko, kst, L, Dk, vec_qk);
        load_tile<GDK>(Ks, LDK, k + ko, kst, L, Dk, vec_qk);
        load_tile<BV>(Vs, LDV, v + (long long)t0 * vst + (long long)h * Dv + v0, vst, L, vcols, vec_v);
        long long mo = ((long long)h * NC + c) * GC * GC;
        load_tile<GC>(Tm, LDC, tinv + mo, GC, GC, GC, true);
        load_tile<GC>(Pm, LDC, pmat + mo, GC, GC, GC, true);
        if (tid < GC) cp_async16(Cf + tid, coef + ((long long)h * NC + c) * GC + tid, true);
    };

    // The block's state columns: warp w holds rows 16·(w & 7).. and columns HB·(w >> 3).. as
    // NH accumulator tiles.
    float sacc[NH][4];
    const int sr = 16 * (w & 7) + gid, sc = HB * (w >> 3);
#pragma unroll
    for (int j = 0; j < NH; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r = sr + 8 * (e >> 1), cc = v0 + sc + 8 * j + 2 * tig + (e & 1);
            sacc[j][e] = (r < Dk && cc < Dv) ? state[((long long)h * Dk + r) * Dv + cc] : 0.f;
        }
#pragma unroll
    for (int j = 0; j < NH; ++j) {
        *(unsigned*)(Sb + sr * LDV + sc + 8 * j + 2 * tig) = pack_bf16(sacc[j][0], sacc[j][1]);
        *(unsigned*)(Sb + (sr + 8) * LDV + sc + 8 * j + 2 * tig) = pack_bf16(sacc[j][2], sacc[j][3]);
    }

    // One cp.async group per chunk (empty past the last), so that waiting for all but the NS − 2
    // newest groups waits for chunk c.
#pragma unroll
    for (int p = 0; p < NS - 1; ++p) {
        if (p < NC) issue(p);
        cp_async_commit();
    }
    for (int c = 0; c < NC; ++c) {
        cp_async_wait_group<NS - 2>();
        __syncthreads();
        if (c + NS - 1 < NC) issue(c + NS - 1);
        cp_async_commit();
        const float dc = decay[(long long)h * NC + c];
        const bf16_t* Qs = stage(c);
        const bf16_t* Ks = Qs + GC * LDK;
        const bf16_t* Vs = Ks + GC * LDK;
        const bf16_t* Tm = Vs + GC * LDV;
        const bf16_t* Pm = Tm + GC * LDC;
        const float4* Cf = (const float4*)(Pm + GC * LDC);
        const int t0 = c * GC;

        // X = K S (warps 0-7) or O = Q S (warps 8-15), rows 16·rt.., columns cb..cb+HB.
        const int rt = w & 3, cb = HB * ((w >> 2) & 1);
        const bf16_t* Am = w < 8 ? Ks : Qs;
        float acc[NH][4];
#pragma unroll
        for (int j = 0; j < NH; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < GDK / 16; ++ks) {
            unsigned a[4];
            frag_a(a, Am, LDK, 16 * rt, 16 * ks);
#pragma unroll
            for (int jp = 0; jp < NH / 2; ++jp) {
                unsigned b[4];
                frag_b_kn(b, Sb, LDV, 16 * ks, cb + 16 * jp);
                mma_bf16(acc[2 * jp], a, b[0], b[1]);
                mma_bf16(acc[2 * jp + 1], a, b[2], b[3]);
            }
        }
        const int r0 = 16 * rt + gid;
        const float4 c0 = Cf[r0], c1 = Cf[r0 + 8];
        if (w < 8) {
            // Y = β (V − rk e^G X)
#pragma unroll
            for (int j = 0; j < NH; ++j) {
                int cc = cb + 8 * j + 2 * tig;
                unsigned va = *(const unsigned*)(Vs + r0 * LDV + cc);
                unsigned vb = *(const unsigned*)(Vs + (r0 + 8) * LDV + cc);
                *(unsigned*)(Ys + r0 * LDV + cc) = pack_bf16(c0.z * (bf16lo(va) - c0.y * acc[j][0]),
                                                             c0.z * (bf16hi(va) - c0.y * acc[j][1]));
                *(unsigned*)(Ys + (r0 + 8) * LDV + cc) = pack_bf16(c1.z * (bf16lo(vb) - c1.y * acc[j][2]),
                                                                   c1.z * (bf16hi(vb) - c1.y * acc[j][3]));
            }
        } else {
#pragma unroll
            for (int j = 0; j < NH; ++j) {
                acc[j][0] *= c0.x;
                acc[j][1] *= c0.x;
                acc[j][2] *= c1.x;
                acc[j][3] *= c1.x;
            }
        }
        __syncthreads();

        // V' = T Y: warp w, rows 16·rt.., columns 8·NE·(w >> 2).. (T is lower triangular).
        {
            const int n0 = 8 * NE * (w >> 2);
            float vacc[NE][4];
#pragma unroll
            for (int j = 0; j < NE; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) vacc[j][e] = 0.f;
            for (int ks = 0; ks <= rt; ++ks) {
                unsigned a[4];
                frag_a(a, Tm, LDC, 16 * rt, 16 * ks);
                if constexpr (NE == 2) {
                    unsigned b[4];
                    frag_b_kn(b, Ys, LDV, 16 * ks, n0);
                    mma_bf16(vacc[0], a, b[0], b[1]);
                    mma_bf16(vacc[NE - 1], a, b[2], b[3]);
                } else {
                    unsigned b[2];
                    frag_b_kn_x2(b, Ys, LDV, 16 * ks, n0);
                    mma_bf16(vacc[0], a, b[0], b[1]);
                }
            }
#pragma unroll
            for (int j = 0; j < NE; ++j) {
                int cc = n0 + 8 * j + 2 * tig;
                *(unsigned*)(Vp + r0 * LDV + cc) = pack_bf16(vacc[j][0], vacc[j][1]);
                *(unsigned*)(Vp + (r0 + 8) * LDV + cc) = pack_bf16(vacc[j][2], vacc[j][3]);
                *(unsigned*)(Vd + r0 * LDV + cc) = pack_bf16(c0.w * vacc[j][0], c0.w * vacc[j][1]);
                *(unsigned*)(Vd + (r0 + 8) * LDV + cc) = pack_bf16(c1.w * vacc[j][2], c1.w * vacc[j][3]);
            }
        }
        __syncthreads();

        if (w >= 8) {
            // O += P V' (P lower triangular), then out.
            for (int ks = 0; ks <= rt; ++ks) {
                unsigned a[4];
                frag_a(a, Pm, LDC, 16 * rt, 16 * ks);
#pragma unroll
                for (int jp = 0; jp < NH / 2; ++jp) {
                    unsigned b[4];
                    frag_b_kn(b, Vp, LDV, 16 * ks, cb + 16 * jp);
                    mma_bf16(acc[2 * jp], a, b[0], b[1]);
                    mma_bf16(acc[2 * jp + 1], a, b[2], b[3]);
                }
            }
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                int t = t0 + r0 + 8 * hf;
                if (t >= T) continue;
                float* orow = out + ((long long)t * Hv + h) * Dv + v0;
#pragma unroll
                for (int j = 0; j < NH; ++j) {
                    int cc = cb + 8 * j + 2 * tig;
                    float x0 = acc[j][2 * hf], x1 = acc[j][2 * hf + 1];
                    if (cc + 1 < vcols && (Dv & 1) == 0) {
                        *(float2*)(orow + cc) = make_float2(x0, x1);
                    } else {
                        if (cc < vcols) orow[cc] = x0;
                        if (cc + 1 < vcols) orow[cc + 1] = x1;
                    }
                }
            }
        }

        // S ← e^{G_last} S + Kᵀ (ks ⊙ V') on this warp's state tile.
#pragma unroll
        for (int j = 0; j < NH; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sacc[j][e] *= dc;
#pragma unroll
        for (int ks = 0; ks < GC / 16; ++ks) {
            unsigned a[4];
            frag_a_t(a, Ks, LDK, 16 * (w & 7), 16 * ks);
#pragma unroll
            for (int jp = 0; jp < NH / 2; ++jp) {
                unsigned b[4];
                frag_b_kn(b, Vd, LDV, 16 * ks, sc + 16 * jp);
                mma_bf16(sacc[2 * jp], a, b[0], b[1]);
                mma_bf16(sacc[2 * jp + 1], a, b[2], b[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < NH; ++j) {
            *(unsigned*)(Sb + sr * LDV + sc + 8 * j + 2 * tig) = pack_bf16(sacc[j][0], sacc[j][1]);
            *(unsigned*)(Sb + (sr + 8) * LDV + sc + 8 * j + 2 * tig) = pack_bf16(sacc[j][2], sacc[j][3]);
        }
    }

#pragma unroll
    for (int j = 0; j < NH; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r = sr + 8 * (e >> 1), cc = v0 + sc + 8 * j + 2 * tig + (e & 1);
            if (r < Dk && cc < Dv) state[((long long)h * Dk + r) * Dv + cc] = sacc[j][e];
        }
}

extern "C" __global__ void __launch_bounds__(GDN_STATE_THREADS, 1) gdn_chunk_state32(
    const bf16_t* q, const bf16_t* k, const bf16_t* v,
    const bf16_t* tinv, const bf16_t* pmat, const float4* coef,
    const float* decay, float* __restrict__ state, float* __restrict__ out, int T, int Hk, int Hv,
    int Dk, int Dv) {
    pdl_entry();
    gdn_chunk_state<32, 3>(q, k, v, tinv, pmat, coef, decay, state, out, T, Hk, Hv, Dk, Dv);
}

extern "C" __global__ void __launch_bounds__(GDN_STATE_THREADS, 1) gdn_chunk_state64(
    const bf16_t* q, const bf16_t* k, const bf16_t* v,
    const bf16_t* tinv, const bf16_t* pmat, const float4* coef,
    const float* decay, float* __restrict__ state, float* __restrict__ out, int T, int Hk, int Hv,
    int Dk, int Dv) {
    pdl_entry();
    gdn_chunk_state<64, 2>(q, k, v, tinv, pmat, coef, decay, state, out, T, Hk, Hv, Dk, Dv);
}
