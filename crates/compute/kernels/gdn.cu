// Gated DeltaNet decode step (one token for each of B sequences), f32 state.
//
// The layer's fused input projection gives, per batch row b, proj_b = proj + b·P with
// proj_b = [qkv (C = 2·Hk·Dk + Hv·Dv) | z (Hv·Dv) | b (Hv) | a (Hv)]. Row b's sequence keeps its
// states in slot slots[b] of the layer's state arrays; mixed: [B, C]; out: [B, Hv·Dv].
//
// gdn_conv_step: mixed_b[c] = silu(Σ_{j<K-1} w[c, j] · st[j, c] + w[c, K-1] · proj_b[c]), then the
//   conv state st = conv + slots[b]·(K-1)·C, [K-1, C] oldest first, shifts by one and takes
//   proj_b[c] (common.cuh's conv_load/conv_advance). w: [C, K], K ≤ CONV_KMAX.
//   grid (ceil(C/256), B), block 256.
//
// gdn_conv_verify and gdn_verify: the same for the tokens of one sequence's verify pass in turn
//   (speculative decoding), keeping the states after each token (see each kernel).
//
// gdn_step: nc blocks per (value head h, row b), grid (Hv·nc, B), block cw × GDN_ROW_GROUPS
//   threads; block x = h·nc + c takes the state columns j = c·cw … c·cw + cw − 1. On sm_90+ the
//   host launches cw = 32 and nc = ⌈Dv/32⌉ as one cluster per head (a 256-thread block holding
//   16 KB of a 128 × 128 state fits beside the input projection's blocks, so it becomes resident
//   and loads its state before its wait; one 1024-thread block per head could not. The staged
//   input projection's register cap leaves it that room, mma_vec.cu); before, nc = 1 and cw = Dv
//   rounded up to 32.
//   State S_h of row b at state + (slots[b]·Hv + h)·Dk·Dv;
//   kh = h / (Hv / Hk); q, k = l2norm(mixed q/k of kh) (eps 1e-6), q ·= 1/sqrt(Dk); v = mixed v of h;
//   g = neg_a[h] · softplus(a[h] + dt_bias[h]); β = sigmoid(b[h]); state S_h: [Dk, Dv].
//   Thread (j, r) keeps rows r·⌈Dk/R⌉… of column j of S_h in registers: S ← e^g S;
//   δ_j = β (v_j − Σ_i k_i S_ij) (partial sums over the R row groups merged in shared memory);
//   S_ij += k_i δ_j; o_j = Σ_i q_i S_ij; then the gated RMSNorm out_j = o_j / rms(o) · w_j · silu(z_j),
//   Σ o² over the head summed per block and then over the cluster's blocks in rank order; the
//   updated column is stored after that. Dk ≤ GDN_DK_MAX, Dv ≤ GDN_DV_MAX.
// gdn_step128: the same for Dk = Dv = 128 and cw = 32 (every Qwen3.5/3.6 and Qwen3-Next model),
//   the sizes compiled in: no branch per state row, 1,011 SASS instructions against 2,106.
#define GDN_DK_MAX 128
#define GDN_DV_MAX 128
#define GDN_ROW_GROUPS 8
#define GDN_ROWS_MAX (GDN_DK_MAX / GDN_ROW_GROUPS)
// Most tokens of one verify pass (gdn_verify, gdn_conv_verify): a token and up to 4 drafts.
#define GDN_VERIFY_MAX 5

extern "C" __global__ void gdn_conv_step(const float* proj, float* __restrict__ state,
                                         const float* __restrict__ w, float* __restrict__ mixed,
                                         int C, int K, const int* __restrict__ slots, long long P) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int row = blockIdx.y;
    bool live = c < C;
    // The weights, the slot and the conv state come from no kernel of this step (the state is
    // this kernel's own): loaded before the wait, so only proj's load follows it.
    float wv[CONV_KMAX], st[CONV_KMAX];
    if (live) {
        state += (long long)slots[row] * (K - 1) * C;
        conv_load(w, state, c, C, K, wv, st);
    }
    pdl_entry();
    if (!live) return;
    proj += row * P;
    mixed += (long long)row * C;
    mixed[c] = conv_advance(wv, st, state, c, C, K, proj[c]);
}

// gdn_conv_verify: gdn_conv_step over the R ≤ GDN_VERIFY_MAX consecutive tokens of the one
//   sequence in slot slots[0] (rows 0 … R−1 of proj and mixed), in order, each through the same
//   conv_advance; the window after token t < R − 1 goes to saved + t·(K−1)·C ([K−1, C] as the
//   state), the one after the last to the slot. grid ceil(C/256), block 256.
extern "C" __global__ void gdn_conv_verify(const float* proj, float* __restrict__ state,
                                           const float* __restrict__ w, float* __restrict__ mixed, int C, int K,
                                           const int* __restrict__ slots, long long P, int R,
                                           float* __restrict__ saved) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    bool live = c < C;
    float wv[CONV_KMAX], st[CONV_KMAX];
    if (live) {
        state += (long long)slots[0] * (K - 1) * C;
        conv_load(w, state, c, C, K, wv, st);
    }
    pdl_entry();
    if (!live) return;
    for (int t = 0; t < R; ++t) {
        float* dst = t + 1 < R ? saved + (long long)t * (K - 1) * C : state;
        const float x = proj[t * P + c];
        mixed[(long long)t * C + c] = conv_advance(wv, st, dst, c, C, K, x);
#pragma unroll
        for (int j = 0; j + 1 < CONV_KMAX; ++j)
            if (j + 1 < K - 1) st[j] = st[j + 1];
        if (K > 1) st[K - 2] = x;
    }
}

// gdn_restore: the commit of a verify pass that kept fewer tokens than it ran. Span s
//   (blockIdx.y) of `table` ([spans, 3] u64: dst, src, floats) copies its floats from src to dst:
//   a layer's states kept after the last kept token back into the slot. grid (x, spans), block
//   256, grid-stride loop over each span.
extern "C" __global__ void gdn_restore(const unsigned long long* __restrict__ table) {
    pdl_entry();
    const unsigned long long* t = table + 3 * blockIdx.y;
    float* dst = reinterpret_cast<float*>(t[0]);
    const float* src = reinterpret_cast<const float*>(t[1]);
    const long long n = (long long)t[2];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}

// Every thread of a cluster's CTAs arrives on the cluster barrier at its start (cluster_started)
// and waits on that phase (cluster_ready) before anything is written into another CTA's shared
// memory, which exists once that CTA has started. Before it arrives, thread 0 sets up the CTA's
// mbarrier `bar` for the nc partial sums the cluster's CTAs will send it (4 bytes each,
// cluster_sum).
__device__ __forceinline__ void cluster_started(int nc, unsigned long long* bar) {
    if (nc > 1) {
        if (threadIdx.x == 0 && threadIdx.y == 0) {
            mbar_init(bar);
            mbar_expect_tx(bar, 4 * nc);
        }
        cluster_arrive_relaxed();
    }
}

// Waits until every CTA of the cluster has started (set up its mbarrier): cluster_sum may then
// write into their shared memory. The wait's acquire invalidates L1, so it comes before the
// kernel asks L1 for anything.
__device__ __forceinline__ void cluster_ready(int nc) {
    if (nc > 1) cluster_wait();
}

// The partial sums of a cluster's nc CTAs, added in rank order by every thread: the CTAs of a
// head share its RMSNorm. Each CTA sends its sum into slot[rank] of every CTA of the cluster by
// an asynchronous store that completes on that CTA's mbarrier, and each waits on its own
// mbarrier for the nc sums. A cluster barrier there (arrive.release, wait.acquire) costs more:
// its release compiles to MEMBAR.ALL.GPU, and its acquire invalidates L1 just before the step
// reads z and the norm weights. A CTA leaves only after every sum sent to it
// has arrived, so no store meets a CTA that has left. sm_90+ (clusters); before, the host
// launches one CTA per head and this is the CTA's own sum.
__device__ __forceinline__ float cluster_sum(float mine, float* slot, unsigned long long* bar, int nc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (nc > 1) {
        if (threadIdx.y == 0 && threadIdx.x < nc) {
            unsigned rank;
            asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
            st_async_f1(slot + rank, mine, bar, threadIdx.x);
        }
        mbar_wait(bar, 0);
        float total = 0.f;
        for (int c = 0; c < nc; ++c) total += slot[c];
        return total;
    }
#endif
    return mine;
}

// The shared memory of one token's delta-rule step (gdn_token).
struct GdnSmem {
    float qs[GDN_DK_MAX];
    float ks[GDN_DK_MAX];
    float red[GDN_ROW_GROUPS][GDN_DV_MAX];
    float osq[GDN_DV_MAX];
};

// Where a thread of a head's CTA sits: value head h, state column j (active: one of the head's),
// row group r whose rows start at i0, cw columns a CTA, nc CTAs a head.
struct GdnAt {
    int h, j, r, i0, cw, nc;
    bool active;
};

// Whether row t of the thread's rows is one of the head's (always with fixed sizes that the row
// groups divide: the block is GDN_ROW_GROUPS threads high).
template <int DK>
__device__ __forceinline__ bool gdn_has_row(int t, int i0, int Dk) {
    const int rows = (Dk + GDN_ROW_GROUPS - 1) / GDN_ROW_GROUPS;
    return DK && DK % GDN_ROW_GROUPS == 0 ? t < DK / GDN_ROW_GROUPS : t < rows && i0 + t < Dk;
}

// One token's step of the thread's rows `col` of column j of S_h: reads the token's mixed row
// and projection row, updates col, writes its output row (gated RMSNorm, the head's Σ o² summed
// over the cluster through cl_ss/cl_bar). The decode step (one token a row) and the verify pass
// (several tokens of one sequence in turn) run this same code, so each token's arithmetic is
// the same in both.
template <int DK, int DV>
__device__ __forceinline__ void gdn_token(float (&col)[GDN_ROWS_MAX], GdnSmem& sm, const GdnAt at,
                                          const float* mixed, const float* proj, float* __restrict__ out,
                                          const float* __restrict__ norm_w, int Hk, int Hv, int dk, int dv,
                                          float na, float dtb, float eps, float* cl_ss,
                                          unsigned long long* cl_bar) {
    const int Dk = DK ? DK : dk, Dv = DV ? DV : dv;
    const int h = at.h, j = at.j, r = at.r, i0 = at.i0, cw = at.cw;
    const bool active = at.active;
    const int tid = r * cw + threadIdx.x, jl = threadIdx.x;
    int kh = h / (Hv / Hk);
    int C = 2 * Hk * Dk + Hv * Dv;
    const float* q = mixed + kh * Dk;
    const float* k = mixed + Hk * Dk + kh * Dk;
    const float* v = mixed + 2 * Hk * Dk + h * Dv;
    const float* z = proj + C + h * Dv;
    // The inputs this thread needs, their loads issued together (one round trip, not one per use).
    float qi = tid < Dk ? q[tid] : 0.f, ki = tid < Dk ? k[tid] : 0.f;
    float vj = active ? v[j] : 0.f;
    float b = proj[C + Hv * Dv + h], a = proj[C + Hv * Dv + Hv + h];
    // z is used at the end only: asked of L1 now, without holding registers.
    if (r == 0 && active) l1_prefetch(z + j);
    // The block has at least 256 threads ≥ GDN_DK_MAX: one q and one k value per thread.
    if (tid < Dk) {
        sm.qs[tid] = qi;
        sm.ks[tid] = ki;
    }
    __syncthreads();
    // Every warp reduces the two norms itself (no block barrier needed for them).
    int lane = tid & 31;
    float qq = 0.f, kk = 0.f;
    for (int i = lane; i < Dk; i += 32) {
        qq = fmaf(sm.qs[i], sm.qs[i], qq);
        kk = fmaf(sm.ks[i], sm.ks[i], kk);
    }
    qq = warp_sum(qq);
    kk = warp_sum(kk);
    float rq = rsqrtf(qq + 1e-6f) * rsqrtf((float)Dk);
    float rk = rsqrtf(kk + 1e-6f);
    float decay = expf(na * softplus_f(a + dtb));
    float beta = sigmoid_f(b);

    // Rows [i0, i0 + rows) of column j belong to this thread.
    float part = 0.f;
#pragma unroll
    for (int t = 0; t < GDN_ROWS_MAX; ++t) {
        int i = i0 + t;
        if (active && gdn_has_row<DK>(t, i0, Dk)) {
            col[t] *= decay;
            part = fmaf(sm.ks[i] * rk, col[t], part);
        }
    }
    if (active) sm.red[r][jl] = part;
    __syncthreads();
    float kv = 0.f;
    if (active)
        for (int g = 0; g < GDN_ROW_GROUPS; ++g) kv += sm.red[g][jl];
    __syncthreads();
    float delta = active ? beta * (vj - kv) : 0.f;
    part = 0.f;
#pragma unroll
    for (int t = 0; t < GDN_ROWS_MAX; ++t) {
        int i = i0 + t;
        if (active && gdn_has_row<DK>(t, i0, Dk)) {
            col[t] = fmaf(sm.ks[i] * rk, delta, col[t]);
            part = fmaf(sm.qs[i] * rq, col[t], part);
        }
    }
    if (active) sm.red[r][jl] = part;
    __syncthreads();
    float o = 0.f;
    if (active)
        for (int g = 0; g < GDN_ROW_GROUPS; ++g) o += sm.red[g][jl];
    if (r == 0) sm.osq[jl] = active ? o * o : 0.f;
    __syncthreads();
    float ss = 0.f;
    for (int c = lane; c < cw; c += 32) ss += sm.osq[c];
    ss = cluster_sum(warp_sum(ss), cl_ss, cl_bar, at.nc);
    float rn = rsqrtf(ss / Dv + eps);
    if (r == 0 && active) out[h * Dv + j] = o * rn * norm_w[j] * silu_f(z[j]);
}

// Stores the thread's rows `col` of column j of a state S_h at S (column j's first row).
template <int DK>
__device__ __forceinline__ void gdn_store(float* S, const float (&col)[GDN_ROWS_MAX], const GdnAt at, int Dk,
                                          int Dv) {
#pragma unroll
    for (int t = 0; t < GDN_ROWS_MAX; ++t)
        if (at.active && gdn_has_row<DK>(t, at.i0, Dk)) S[(long long)(at.i0 + t) * Dv] = col[t];
}

// Where this thread sits in the launch (see the file's header).
template <int DV, int CW>
__device__ __forceinline__ GdnAt gdn_at(int dk, int dv, int nc) {
    const int Dv = DV ? DV : dv, cw = CW ? CW : blockDim.x;
    const int h = blockIdx.x / nc, j = (blockIdx.x % nc) * cw + threadIdx.x, r = threadIdx.y;
    const int rows = (dk + GDN_ROW_GROUPS - 1) / GDN_ROW_GROUPS;
    // With fixed sizes the host launches Dv / CW blocks a head: every column is one.
    return GdnAt{h, j, r, r * rows, cw, nc, DV ? true : j < Dv};
}

// The step with the head sizes and block width as template arguments, or 0: those of the launch.
// Fixed sizes (gdn_step128) leave no branch per state row, so ptxas schedules the rows together
// without spilling.
template <int DK, int DV, int CW>
__device__ __forceinline__ void gdn_step_t(const float* mixed, const float* proj, float* __restrict__ state,
                                           const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                           const float* __restrict__ norm_w, float* __restrict__ out, int Hk,
                                           int Hv, int dk, int dv, float eps, const int* __restrict__ slots,
                                           long long P, int nc) {
    const int Dk = DK ? DK : dk, Dv = DV ? DV : dv;
    const int row = blockIdx.y;
    const GdnAt at = gdn_at<DV, CW>(Dk, Dv, nc);
    __shared__ unsigned long long cl_bar;
    cluster_started(nc, &cl_bar);
    // Slots come from the host before the step and the head's parameters from the weights, not
    // from the kernel before.
    int slot = slots[row];
    float na = neg_a[at.h], dtb = dt_bias[at.h];
    // The state is this kernel's own (last written by this layer's step of the token before, an
    // earlier step): its column is loaded before the wait.
    float* S = state + (long long)slot * Hv * Dk * Dv + (long long)at.h * Dk * Dv + at.j;
    float col[GDN_ROWS_MAX];
#pragma unroll
    for (int t = 0; t < GDN_ROWS_MAX; ++t)
        if (at.active && gdn_has_row<DK>(t, at.i0, Dk)) col[t] = S[(long long)(at.i0 + t) * Dv];
    cluster_ready(nc);
    if (at.r == 0 && at.j < Dv) l1_prefetch(norm_w + at.j);
    pdl_entry();
    __shared__ GdnSmem sm;
    __shared__ float cl_ss[GDN_DV_MAX / 32];
    int C = 2 * Hk * Dk + Hv * Dv;
    gdn_token<DK, DV>(col, sm, at, mixed + (long long)row * C, proj + row * P, out + (long long)row * Hv * Dv,
                      norm_w, Hk, Hv, Dk, Dv, na, dtb, eps, cl_ss, &cl_bar);
    // The updated state is stored last, off the way to the outputs.
    gdn_store<DK>(S, col, at, Dk, Dv);
}

// gdn_verify: the verify pass of speculative decoding, R ≤ GDN_VERIFY_MAX consecutive tokens of
// the one sequence in slot slots[0] (rows 0 … R−1 of mixed, proj and out, in order), launched as
// gdn_step with one row: each head's CTAs take the tokens in turn, each token through
// gdn_token as a decode step would. The state after token t < R − 1 is stored at
// saved + (t·Hv + h)·Dk·Dv (the positions a rejected draft rolls back to), the state after the
// last token in the slot. A head's cluster sums each token's Σ o² on an mbarrier of its own.
template <int DK, int DV, int CW>
__device__ __forceinline__ void gdn_verify_t(const float* mixed, const float* proj, float* __restrict__ state,
                                             const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                             const float* __restrict__ norm_w, float* __restrict__ out, int Hk,
                                             int Hv, int dk, int dv, float eps, const int* __restrict__ slots,
                                             long long P, int nc, int R, float* __restrict__ saved) {
    const int Dk = DK ? DK : dk, Dv = DV ? DV : dv;
    const GdnAt at = gdn_at<DV, CW>(Dk, Dv, nc);
    __shared__ unsigned long long cl_bar[GDN_VERIFY_MAX];
    if (nc > 1) {
        if (threadIdx.x == 0 && threadIdx.y == 0)
            for (int t = 0; t < GDN_VERIFY_MAX; ++t) {
                mbar_init(&cl_bar[t]);
                mbar_expect_tx(&cl_bar[t], 4 * nc);
            }
        cluster_arrive_relaxed();
    }
    int slot = slots[0];
    float na = neg_a[at.h], dtb = dt_bias[at.h];
    const long long head = (long long)at.h * Dk * Dv + at.j;
    float* S = state + (long long)slot * Hv * Dk * Dv + head;
    float col[GDN_ROWS_MAX];
#pragma unroll
    for (int t = 0; t < GDN_ROWS_MAX; ++t)
        if (at.active && gdn_has_row<DK>(t, at.i0, Dk)) col[t] = S[(long long)(at.i0 + t) * Dv];
    cluster_ready(nc);
    pdl_entry();
    __shared__ GdnSmem sm;
    __shared__ float cl_ss[GDN_VERIFY_MAX][GDN_DV_MAX / 32];
    int C = 2 * Hk * Dk + Hv * Dv;
    for (int t = 0; t < R; ++t) {
        gdn_token<DK, DV>(col, sm, at, mixed + (long long)t * C, proj + t * P, out + (long long)t * Hv * Dv,
                          norm_w, Hk, Hv, Dk, Dv, na, dtb, eps, cl_ss[t], &cl_bar[t]);
        if (t + 1 < R) gdn_store<DK>(saved + (long long)t * Hv * Dk * Dv + head, col, at, Dk, Dv);
    }
    gdn_store<DK>(S, col, at, Dk, Dv);
}

#define GDN_STEP_ENTRY(NAME, DK, DV, CW)                                                                       \
    extern "C" __global__ void __launch_bounds__(1024)                                                         \
        NAME(const float* mixed, const float* proj, float* __restrict__ state, const float* __restrict__ neg_a, \
             const float* __restrict__ dt_bias, const float* __restrict__ norm_w, float* __restrict__ out,      \
             int Hk, int Hv, int Dk, int Dv, float eps, const int* __restrict__ slots, long long P, int nc) {    \
        gdn_step_t<DK, DV, CW>(mixed, proj, state, neg_a, dt_bias, norm_w, out, Hk, Hv, Dk, Dv, eps, slots, P, nc); \
    }

GDN_STEP_ENTRY(gdn_step, 0, 0, 0)
GDN_STEP_ENTRY(gdn_step128, 128, 128, 32)

#define GDN_VERIFY_ENTRY(NAME, DK, DV, CW)                                                                      \
    extern "C" __global__ void __launch_bounds__(1024)                                                          \
        NAME(const float* mixed, const float* proj, float* __restrict__ state, const float* __restrict__ neg_a,  \
             const float* __restrict__ dt_bias, const float* __restrict__ norm_w, float* __restrict__ out,       \
             int Hk, int Hv, int Dk, int Dv, float eps, const int* __restrict__ slots, long long P, int nc, int R, \
             float* __restrict__ saved) {                                                                       \
        gdn_verify_t<DK, DV, CW>(mixed, proj, state, neg_a, dt_bias, norm_w, out, Hk, Hv, Dk, Dv, eps, slots, P, \
                                 nc, R, saved);                                                                 \
    }

GDN_VERIFY_ENTRY(gdn_verify, 0, 0, 0)
GDN_VERIFY_ENTRY(gdn_verify128, 128, 128, 32)
