// Gated full attention, decode: one new token for each of B sequences. Row b's sequence is in
// slot slots[b]: its caches at k_cache/v_cache + slots[b]·T·Hkv·D ([T, Hkv, D], T the context
// per slot) and its position (the new token's) at pos[slots[b]]. Per row b:
// proj_b = proj + b·P = [per head (q_h (D) | gate_h (D)) × Hq | k (Hkv·D) | v (Hkv·D)];
// q: [B, Hq, D]; out: [B, Hq·D]; part_o: [B, Hq, S, D]; part_ml: [B, Hq, S, 2].
//
// attn_prep: grid (Hq + 2·Hkv, B), block D threads (multiple of 32, ≤ 1024).
//   Blocks < Hq: q_h = rope(rmsnorm(q_h) · qn) → q [Hq, D].
//   Next Hkv blocks: k_h = rope(rmsnorm(k_h) · kn) → k_cache[pos, h]; last Hkv blocks: v_h → v_cache[pos, h].
//   rope: NeoX on dims < R (pairs i, i + R/2), angle pos · inv_freq[i]. Caches: [max_ctx, Hkv, D].
//   row_pos ≠ 0 (prefill: every row in the same slot, consecutive tokens): row b's position is
//   pos[slot] + b instead of pos[slot].
//
// attn_partial: grid (Hq, S splits, B), block 128 (4 warps). Of the S splits the first
//   S_L = min(S, ceil(L / ATTN_SPLIT_MIN)) are used (short contexts: fewer, fuller splits and
//   fewer partials to merge), L = pos + 1; split s < S_L covers positions [s·c, min((s+1)·c, L)),
//   c = ceil(L / S_L). Each warp takes runs of ATTN_POS
//   positions (every 4th run), keeps an online softmax (max m, sum l, acc), and the block merges
//   its warps into
//   part_ml[h, s] = (m, l) and part_o[h, s, :] = acc (unnormalised). Kv head = h / (Hq / Hkv). D ≤ 256.
//
// attn_combine: grid (Hq, B), block D (rounded up to 32): merges the S_L ≤ ATTN_MAX_SPLITS partials and
//   multiplies by sigmoid(gate_h) → out [Hq·D].

extern "C" __global__ void attn_prep(const float* proj, const float* __restrict__ qn,
                                     const float* __restrict__ kn, const float* __restrict__ inv_freq,
                                     float* __restrict__ q_out, float* __restrict__ k_cache,
                                     float* __restrict__ v_cache, const int* __restrict__ pos_arr,
                                     int Hq, int Hkv, int D, int R, float eps,
                                     const int* __restrict__ slots, long long P, long long T, int row_pos) {
    // Slots and positions change only between steps (never in the kernel before).
    int b = blockIdx.x, i = threadIdx.x;
    int row = blockIdx.y, slot = slots[row];
    int pos = pos_arr[slot] + (row_pos ? row : 0);
    pdl_entry();
    extern __shared__ float sh[];
    proj += row * P;
    q_out += (long long)row * Hq * D;
    k_cache += slot * T * Hkv * D;
    v_cache += slot * T * Hkv * D;
    const float* src;
    float* dst;
    const float* scale = nullptr;
    if (b < Hq) {
        src = proj + (long long)b * 2 * D;
        dst = q_out + (long long)b * D;
        scale = qn;
    } else if (b < Hq + Hkv) {
        int h = b - Hq;
        src = proj + (long long)Hq * 2 * D + (long long)h * D;
        dst = k_cache + ((long long)pos * Hkv + h) * D;
        scale = kn;
    } else {
        int h = b - Hq - Hkv;
        src = proj + (long long)Hq * 2 * D + (long long)Hkv * D + (long long)h * D;
        dst = v_cache + ((long long)pos * Hkv + h) * D;
    }
    float x = i < D ? src[i] : 0.f;
    if (!scale) {
        if (i < D) dst[i] = x;
        return;
    }
    float r = rsqrtf(block_sum(x * x) / D + eps);
    if (i < D) sh[i] = x * r * scale[i];
    __syncthreads();
    if (i >= D) return;
    float y = sh[i];
    int half = R / 2;
    if (i < R) {
        int f = i < half ? i : i - half;
        float s, c;
        sincosf((float)pos * inv_freq[f], &s, &c);
        y = i < half ? sh[i] * c - sh[i + half] * s : sh[i] * c + sh[i - half] * s;
    }
    dst[i] = y;
}

#define ATTN_DMAX 256
// Fewest positions a split of attn_partial takes (while there are splits left over).
#define ATTN_SPLIT_MIN 16

// Splits attn_partial uses for a context of L positions.
__device__ __forceinline__ int attn_splits(int L, int S) {
    return min(S, (L + ATTN_SPLIT_MIN - 1) / ATTN_SPLIT_MIN);
}
// Positions a warp works on at once: their loads are all in flight before the math.
#define ATTN_POS 4

extern "C" __global__ void attn_partial(const float* q, const float* k_cache,
                                        const float* v_cache, const int* __restrict__ pos_arr,
                                        float* __restrict__ part_o, float* __restrict__ part_ml,
                                        int Hq, int Hkv, int D, int S, float scale,
                                        const int* __restrict__ slots, long long T) {
    // Slots and positions change only between steps (never in the kernel before).
    int b = blockIdx.z, slot = slots[b];
    int L = pos_arr[slot] + 1;
    int used = attn_splits(L, S);
    if (blockIdx.y >= used) return;
    pdl_entry();
    __shared__ float wm[4], wl[4];
    __shared__ float wacc[4][ATTN_DMAX];
    int h = blockIdx.x, s = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kvh = h / (Hq / Hkv);
    q += (long long)b * Hq * D;
    k_cache += slot * T * Hkv * D;
    v_cache += slot * T * Hkv * D;
    part_o += (long long)b * Hq * S * D;
    part_ml += (long long)b * Hq * S * 2;
    int c = (L + used - 1) / used;
    int start = s * c, end = min(L, start + c);
    const int PER = ATTN_DMAX / 32;
    const long long row = (long long)Hkv * D;
    float qr[PER], acc[PER];
#pragma unroll
    for (int t = 0; t < PER; ++t) {
        int d = lane + 32 * t;
        qr[t] = d < D ? q[(long long)h * D + d] : 0.f;
        acc[t] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int p0 = start + warp * ATTN_POS; p0 < end; p0 += 4 * ATTN_POS) {
        float kv[ATTN_POS][PER];
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            const float* kr = k_cache + (long long)(p0 + u) * row + (long long)kvh * D;
#pragma unroll
            for (int t = 0; t < PER; ++t) {
                int d = lane + 32 * t;
                kv[u][t] = (p0 + u < end && d < D) ? kr[d] : 0.f;
            }
        }
        float sc[ATTN_POS];
        float mn = m;
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            float dot = 0.f;
#pragma unroll
            for (int t = 0; t < PER; ++t) dot = fmaf(qr[t], kv[u][t], dot);
            sc[u] = p0 + u < end ? warp_sum(dot) * scale : NEG_INF;
            mn = fmaxf(mn, sc[u]);
        }
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            const float* vr = v_cache + (long long)(p0 + u) * row + (long long)kvh * D;
#pragma unroll
            for (int t = 0; t < PER; ++t) {
                int d = lane + 32 * t;
                kv[u][t] = (p0 + u < end && d < D) ? vr[d] : 0.f;
            }
        }
        float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int t = 0; t < PER; ++t) acc[t] *= corr;
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            float e = expf(sc[u] - mn);
            l += e;
#pragma unroll
            for (int t = 0; t < PER; ++t) acc[t] = fmaf(e, kv[u][t], acc[t]);
        }
        m = mn;
    }
    if (lane == 0) { wm[warp] = m; wl[warp] = l; }
#pragma unroll
    for (int t = 0; t < PER; ++t) wacc[warp][lane + 32 * t] = acc[t];
    __syncthreads();
    float M = fmaxf(fmaxf(wm[0], wm[1]), fmaxf(wm[2], wm[3]));
    long long idx = (long long)h * S + s;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < 4; ++w)
            if (wl[w] > 0.f) o += wacc[w][d] * expf(wm[w] - M);
        part_o[idx * D + d] = o;
    }
    if (threadIdx.x == 0) {
        float Ls = 0.f;
        for (int w = 0; w < 4; ++w)
            if (wl[w] > 0.f) Ls += wl[w] * expf(wm[w] - M);
        part_ml[idx * 2] = M;
        part_ml[idx * 2 + 1] = Ls;
    }
}

#define ATTN_MAX_SPLITS 256

extern "C" __global__ void attn_combine(const float* part_o, const float* part_ml,
                                        const float* proj, float* __restrict__ out,
                                        int D, int S, int Hq, long long P,
                                        const int* __restrict__ pos_arr, const int* __restrict__ slots) {
    int h = blockIdx.x, d = threadIdx.x;
    int row = blockIdx.y;
    const int used = attn_splits(pos_arr[slots[row]] + 1, S);
    pdl_entry();
    // The gate comes from the projection three kernels back: read after the wait (kernels ahead
    // of their wait may overlap any earlier kernel of the step, see pdl_entry).
    proj += row * P;
    float gate = d < D ? proj[(long long)h * 2 * D + D + d] : 0.f;
    __shared__ float wts[ATTN_MAX_SPLITS];
    part_o += (long long)row * Hq * S * D;
    part_ml += (long long)row * Hq * S * 2;
    out += (long long)row * Hq * D;
    const float* ml = part_ml + (long long)h * S * 2;
    // Split weights e^{m_s − M} once per block, in shared memory; empty splits weigh 0.
    float mloc = NEG_INF;
    for (int s = d; s < used; s += blockDim.x)
        if (ml[2 * s + 1] > 0.f) mloc = fmaxf(mloc, ml[2 * s]);
    float M = block_max(mloc);
    float dl = 0.f;
    for (int s = d; s < used; s += blockDim.x) {
        float l = ml[2 * s + 1];
        float f = l > 0.f ? expf(ml[2 * s] - M) : 0.f;
        wts[s] = f;
        dl += l * f;
    }
    float den = block_sum(dl);
    if (d >= D) return;
    float num = 0.f;
    const float* po = part_o + (long long)h * S * D + d;
#pragma unroll 8
    for (int s = 0; s < used; ++s) num = fmaf(po[(long long)s * D], wts[s], num);
    out[(long long)h * D + d] = num / den * sigmoid_f(gate);
}
