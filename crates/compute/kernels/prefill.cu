// Prefill of one sequence: T tokens per launch, f32 activations. Row t of a [T, ·] buffer is
// token t of the pass; the sequence's state pointers arrive already offset to its slot.
//
// gdn_conv_rows: mixed[t, c] = silu(Σ_{j<K} w[c, j] · win[t + j, c]) where win = [state (K−1
//   rows, oldest first) ; x_0 .. x_{T−1}] and x_t[c] = proj[t·P + c]. state: [K−1, C] (read
//   only here); w: [C, K]; mixed: [T, C]. grid (ceil(C/256), T), block 256.
// gdn_conv_state: state[j, c] = win[T + j, c] for j < K−1 (the last K−1 inputs). Runs after
//   gdn_conv_rows. grid ceil(C/256), block 256 (each thread walks j upwards: win[T + j] never
//   lies below an entry still to be written).
// gdn_pack: from mixed [T, C = 2·Hk·Dk + Hv·Dv] = [q | k | v] and proj rows
//   [qkv (C) | z (Hv·Dv) | b (Hv) | a (Hv)]: q, k bf16 [T, Hk·Dk], v bf16 [T, Hv·Dv] (round to
//   nearest even), g[t, h] = neg_a[h] · softplus(a + dt_bias[h]) and beta[t, h] = sigmoid(b),
//   f32 [T, Hv]. grid (ceil(C/256), T), block 256 (Hv ≤ 256: block x = 0 also writes the gates).
// gated_rmsnorm_rows: out[t, h, j] = o[t, h, j] / sqrt(mean_j o² + eps) · w[j] · silu(z) with
//   o: [T, Hv, Dv], z = proj[t·P + z_off + h·Dv + j]; out: [T, Hv·Dv]. grid (Hv, T),
//   block Dv rounded up to 32 (≤ 1024).
//
// gdn_rec_rows: the gated delta rule over T tokens in f32, token by token (the arithmetic of
//   gdn_step in gdn.cu, so a prefill leaves the state a decode would): block (h, column group cg)
//   owns value columns 32·cg + 0..32 of head h, grid (Hv, ceil(Dv/32)), block (32, GR_ROWS):
//   thread (j, r) keeps rows r·⌈Dk/GR_ROWS⌉… of column j of S_h (state + h·Dk·Dv, [Dk, Dv]) in
//   registers for the whole pass. Per token t: q, k = l2norm of mixed row t's key head
//   h / (Hv/Hk) (q also ·1/sqrt(Dk)), v = mixed v of h, gate g = neg_a·softplus(a + dt_bias),
//   β = sigmoid(b) from proj row t; S ← e^g S; δ = β (v − Sᵀk); S += k δᵀ; o = Sᵀq → out
//   [T, Hv, Dv] (before the gated norm). Dk ≤ 128.
//
// moe_group: pairs i < n (token i / KS, slot i % KS) with expert 0 ≤ ids[i] < E (a negative id,
//   another GPU's expert, is left out), sorted by expert
//   (counting sort; order inside an expert unspecified): order[n] pair indices, tiles of at most
//   `tile` pairs of one expert as int3 (expert, first index into order, count), their number in
//   n_tiles[0]. One block of 1024 threads (a multiple of 32, at most 1024); E ≤ MG_EMAX.

extern "C" __global__ void gdn_conv_rows(const float* proj, long long P,
                                         const float* state, const float* __restrict__ w,
                                         float* __restrict__ mixed, int C, int K) {
    pdl_entry();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    int t = blockIdx.y;
    const float* wc = w + (long long)c * K;
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
        int src = t - (K - 1) + j;
        float x = src >= 0 ? proj[(long long)src * P + c] : state[(long long)(K - 1 + src) * C + c];
        acc = fmaf(wc[j], x, acc);
    }
    mixed[(long long)t * C + c] = silu_f(acc);
}

extern "C" __global__ void gdn_conv_state(const float* proj, long long P, float* __restrict__ state,
                                          int C, int K, int T) {
    pdl_entry();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int j = 0; j < K - 1; ++j) {
        int idx = T + j;
        float v = idx < K - 1 ? state[(long long)idx * C + c] : proj[(long long)(idx - (K - 1)) * P + c];
        state[(long long)j * C + c] = v;
    }
}

__device__ __forceinline__ bf16_t to_bf16(float v) {
    unsigned int b = __float_as_uint(v);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (bf16_t)(b >> 16);
}

extern "C" __global__ void gdn_pack(const float* mixed, const float* proj, long long P,
                                    const float* __restrict__ neg_a, const float* __restrict__ dt_bias,
                                    bf16_t* __restrict__ q, bf16_t* __restrict__ k, bf16_t* __restrict__ v,
                                    float* __restrict__ g, float* __restrict__ beta, int Hk, int Hv, int Dk, int Dv) {
    pdl_entry();
    int t = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    int kd = Hk * Dk, vd = Hv * Dv, C = 2 * kd + vd;
    const float* row = proj + (long long)t * P;
    if (c < C) {
        bf16_t b = to_bf16(mixed[(long long)t * C + c]);
        if (c < kd) q[(long long)t * kd + c] = b;
        else if (c < 2 * kd) k[(long long)t * kd + c - kd] = b;
        else v[(long long)t * vd + c - 2 * kd] = b;
    }
    if (blockIdx.x == 0 && threadIdx.x < Hv) {
        int h = threadIdx.x;
        float bb = row[C + vd + h], a = row[C + vd + Hv + h];
        g[(long long)t * Hv + h] = neg_a[h] * softplus_f(a + dt_bias[h]);
        beta[(long long)t * Hv + h] = sigmoid_f(bb);
    }
}

extern "C" __global__ void gated_rmsnorm_rows(const float* o, const float* proj,
                                              long long P, int z_off, const float* __restrict__ w,
                                              float* __restrict__ out, int Hv, int Dv, float eps) {
    pdl_entry();
    int h = blockIdx.x, t = blockIdx.y, j = threadIdx.x;
    long long base = ((long long)t * Hv + h) * Dv;
    float x = j < Dv ? o[base + j] : 0.f;
    float r = rsqrtf(block_sum(x * x) / Dv + eps);
    if (j < Dv) {
        float z = proj[(long long)t * P + z_off + (long long)h * Dv + j];
        out[base + j] = x * r * w[j] * silu_f(z);
    }
}

#define GR_ROWS 8
#define GR_DK 128
#define GR_RMAX (GR_DK / GR_ROWS)

extern "C" __global__ void __launch_bounds__(256) gdn_rec_rows(
    const float* mixed, const float* proj, long long P, float* __restrict__ state,
    const float* __restrict__ neg_a, const float* __restrict__ dt_bias, float* __restrict__ out, int T, int Hk,
    int Hv, int Dk, int Dv) {
    pdl_entry();
    __shared__ float qs[GR_DK], ks[GR_DK];
    __shared__ float red1[GR_ROWS][32], red2[GR_ROWS][32];
    int h = blockIdx.x, lj = threadIdx.x, r = threadIdx.y;
    int j = blockIdx.y * 32 + lj;
    int tid = r * 32 + lj, nt = 32 * GR_ROWS;
    int kh = h / (Hv / Hk);
    int C = 2 * Hk * Dk + Hv * Dv;
    int rows = (Dk + GR_ROWS - 1) / GR_ROWS;
    int i0 = r * rows;
    bool active = j < Dv;
    float* S = state + (long long)h * Dk * Dv + j;
    float col[GR_RMAX];
#pragma unroll
    for (int u = 0; u < GR_RMAX; ++u) {
        int i = i0 + u;
        col[u] = (active && u < rows && i < Dk) ? S[(long long)i * Dv] : 0.f;
    }
    float na = neg_a[h], dtb = dt_bias[h];
    for (int t = 0; t < T; ++t) {
        const float* m = mixed + (long long)t * C;
        const float* pr = proj + (long long)t * P;
        for (int i = tid; i < Dk; i += nt) {
            qs[i] = m[kh * Dk + i];
            ks[i] = m[Hk * Dk + kh * Dk + i];
        }
        __syncthreads();
        float qq = 0.f, kk = 0.f;
        for (int i = lj; i < Dk; i += 32) {
            qq = fmaf(qs[i], qs[i], qq);
            kk = fmaf(ks[i], ks[i], kk);
        }
        qq = warp_sum(qq);
        kk = warp_sum(kk);
        float rq = rsqrtf(qq + 1e-6f) * rsqrtf((float)Dk);
        float rk = rsqrtf(kk + 1e-6f);
        float b = pr[C + Hv * Dv + h], a = pr[C + Hv * Dv + Hv + h];
        float decay = expf(na * softplus_f(a + dtb));
        float beta = sigmoid_f(b);
        float part = 0.f;
#pragma unroll
        for (int u = 0; u < GR_RMAX; ++u) {
            int i = i0 + u;
            if (active && u < rows && i < Dk) {
                col[u] *= decay;
                part = fmaf(ks[i] * rk, col[u], part);
            }
        }
        red1[r][lj] = part;
        __syncthreads();
        float kv = 0.f;
        for (int g = 0; g < GR_ROWS; ++g) kv += red1[g][lj];
        float delta = active ? beta * (m[2 * Hk * Dk + h * Dv + j] - kv) : 0.f;
        part = 0.f;
#pragma unroll
        for (int u = 0; u < GR_RMAX; ++u) {
            int i = i0 + u;
            if (active && u < rows && i < Dk) {
                col[u] = fmaf(ks[i] * rk, delta, col[u]);
                part = fmaf(qs[i] * rq, col[u], part);
            }
        }
        red2[r][lj] = part;
        __syncthreads();
        if (r == 0 && active) {
            float o = 0.f;
            for (int g = 0; g < GR_ROWS; ++g) o += red2[g][lj];
            out[((long long)t * Hv + h) * Dv + j] = o;
        }
    }
#pragma unroll
    for (int u = 0; u < GR_RMAX; ++u) {
        int i = i0 + u;
        if (active && u < rows && i < Dk) S[(long long)i * Dv] = col[u];
    }
}

#define MG_EMAX 1040

extern "C" __global__ void __launch_bounds__(1024) moe_group(const int* ids, int n, int E,
                                                             int* __restrict__ order, int* __restrict__ tiles,
                                                             int* __restrict__ n_tiles, int tile) {
    pdl_entry();
    __shared__ int cnt[MG_EMAX], off[MG_EMAX], toff[MG_EMAX];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (ids[i] >= 0) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    // Exclusive prefix sums of the counts and tile counts: thread t sums experts [per·t,
    // per·t + per), then a scan over the block's threads (within warps, then over warp totals).
    __shared__ int warp_a[32], warp_t[32];
    const int per = (E + blockDim.x - 1) / blockDim.x, e0 = threadIdx.x * per, e1 = min(e0 + per, E);
    int a = 0, nt = 0;
    for (int e = e0; e < e1; ++e) {
        a += cnt[e];
        nt += (cnt[e] + tile - 1) / tile;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, own_a = a, own_t = nt;
    for (int o = 1; o < 32; o <<= 1) {
        const int va = __shfl_up_sync(0xffffffffu, a, o), vt = __shfl_up_sync(0xffffffffu, nt, o);
        if (lane >= o) {
            a += va;
            nt += vt;
        }
    }
    if (lane == 31) {
        warp_a[warp] = a;
        warp_t[warp] = nt;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        int wa = lane < warps ? warp_a[lane] : 0, wt = lane < warps ? warp_t[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int va = __shfl_up_sync(0xffffffffu, wa, o), vt = __shfl_up_sync(0xffffffffu, wt, o);
            if (lane >= o) {
                wa += va;
                wt += vt;
            }
        }
        warp_a[lane] = wa;
        warp_t[lane] = wt;
        if (lane == warps - 1) n_tiles[0] = wt;
    }
    __syncthreads();
    a += (warp ? warp_a[warp - 1] : 0) - own_a;
    nt += (warp ? warp_t[warp - 1] : 0) - own_t;
    for (int e = e0; e < e1; ++e) {
        off[e] = a;
        toff[e] = nt;
        a += cnt[e];
        nt += (cnt[e] + tile - 1) / tile;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        for (int s = 0, ti = toff[e]; s < cnt[e]; s += tile, ++ti) {
            tiles[3 * ti] = e;
            tiles[3 * ti + 1] = off[e] + s;
            tiles[3 * ti + 2] = min(tile, cnt[e] - s);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (ids[i] >= 0) order[atomicAdd(&off[ids[i]], 1)] = i;
}
