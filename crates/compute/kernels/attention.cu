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
//   row_pos ≠ 0 (prefill, and the verify pass of speculative decoding: every row in the same
//   slot, consecutive tokens): row b's position is pos[slot] + b instead of pos[slot], here and
//   in attn_partial and attn_combine.
//
// attn_partial: grid (Hkv·⌈G/ATTN_GQA⌉, S splits, B), block 256 (8 warps), dynamic shared memory
//   8·ATTN_STAGES·ATTN_POS·2 KB; G = Hq/Hkv q heads per kv head. Block x serves kv head
//   x / ⌈G/ATTN_GQA⌉ and up to ATTN_GQA of its q heads, so each K/V row is read once for all of
//   them (the 8 q heads a kv head of Qwen3.5/3.6 and Qwen3-Next, where a block per q head would
//   read each row 8 times through L2).
//   Of the S splits the first S_L = min(S, ceil(L / ATTN_SPLIT_MIN)) are used (short contexts:
//   fewer, fuller splits and fewer partials to merge), L = pos + 1; split s < S_L covers positions
//   [s·c, min((s+1)·c, L)), c = ceil(L / S_L). Each warp takes runs of ATTN_POS positions (every
//   8th run), copied into its shared memory ATTN_STAGES − 1 runs ahead; lane l holds dims
//   4l..4l+3 and 128+4l..128+4l+3 of every head (D % 4 == 0, D ≤ 256), sums the heads' dots in
//   one reduction (attn_reduce_heads) and keeps head (l >> 2)'s online softmax (max m, sum l)
//   and every head's accumulator over its dims. The block merges its warps into
//   part_ml[h, s] = (m, l) and part_o[h, s, :] = acc (unnormalised) for each of its heads h.
//   The K/V rows before the token's own were written by earlier steps: the first runs are copied
//   before the wait on the kernel before, which writes row L − 1 (read from global memory after
//   it: copying that one row into shared memory after the wait gains nothing).
//
// attn_combine: grid (Hq, B), block D (rounded up to 32): merges the S_L ≤ ATTN_MAX_SPLITS partials and
//   multiplies by sigmoid(gate_h) → out [Hq·D]. Thread d loads dim d of the first
//   ATTN_COMBINE_REGS partials right after its wait, with the gate and the splits' (m, l), and
//   sums them in split order (the same bits as loading each in turn): one round trip to L2
//   instead of two.

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
    // The head's norm scale and the rotation of position pos depend on no kernel before: read
    // and computed ahead of the wait.
    const float* scale = b < Hq ? qn : b < Hq + Hkv ? kn : nullptr;
    const float sc = scale && i < D ? scale[i] : 0.f;
    const int half = R / 2;
    float s = 0.f, c = 1.f;
    if (scale && i < R) sincosf((float)pos * inv_freq[i < half ? i : i - half], &s, &c);
    pdl_entry();
    extern __shared__ float sh[];
    proj += row * P;
    q_out += (long long)row * Hq * D;
    k_cache += slot * T * Hkv * D;
    v_cache += slot * T * Hkv * D;
    const float* src;
    float* dst;
    if (b < Hq) {
        src = proj + (long long)b * 2 * D;
        dst = q_out + (long long)b * D;
    } else if (b < Hq + Hkv) {
        int h = b - Hq;
        src = proj + (long long)Hq * 2 * D + (long long)h * D;
        dst = k_cache + ((long long)pos * Hkv + h) * D;
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
    if (i < D) sh[i] = x * r * sc;
    __syncthreads();
    if (i >= D) return;
    float y = sh[i];
    if (i < R) y = i < half ? sh[i] * c - sh[i + half] * s : sh[i] * c + sh[i - half] * s;
    dst[i] = y;
}

#define ATTN_DMAX 256
// Fewest positions a split of attn_partial takes (while there are splits left over).
#define ATTN_SPLIT_MIN 16

// Splits attn_partial uses for a context of L positions.
__device__ __forceinline__ int attn_splits(int L, int S) {
    return min(S, (L + ATTN_SPLIT_MIN - 1) / ATTN_SPLIT_MIN);
}
// Positions a warp works on at once, and runs of them in flight: a warp copies its K and V rows
// into its own shared memory ATTN_STAGES − 1 runs ahead (cp.async, each lane the float4s it
// reads back itself, so no barrier), the first runs before its wait.
#define ATTN_POS 2
#define ATTN_STAGES 4
// Most q heads one attn_partial block serves from each K/V row it loads: one per warp when the
// block's warps merge.
#define ATTN_GQA 8

// Lane l's dims of a head: float4 c (c < 2) holds dims 128·c + 4·l .. 128·c + 4·l + 3.
__device__ __forceinline__ bool attn_dims(int c, int lane, int D) { return 128 * c + 4 * lane < D; }

__device__ __forceinline__ void attn_unpack(float4 a, float4 b, float out[8]) {
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// Lane l's dims of the head row at r, read from global memory (zeros where !ok0 / !ok1).
__device__ __forceinline__ void attn_load_row(const float* r, int lane, bool ok0, bool ok1, float out[8]) {
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    attn_unpack(ok0 ? *reinterpret_cast<const float4*>(r + 4 * lane) : z,
                ok1 ? *reinterpret_cast<const float4*>(r + 128 + 4 * lane) : z, out);
}

// The ATTN_GQA lanes' partial dots v[j] (one per head) summed over the warp: lane l ends with
// head (l >> 2)'s sum. Each halving step keeps half the heads and adds the partner's half
// (xor 16, 8, 4: lanes with the bit set keep the upper half), then the four lanes of a head
// sum (xor 2, 1): 9 shuffles where eight warp sums take 40.
__device__ __forceinline__ float attn_reduce_heads(const float v[ATTN_GQA], int lane) {
    float a[4], b[2];
    const bool up16 = lane & 16, up8 = lane & 8, up4 = lane & 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float send = up16 ? v[i] : v[i + 4], keep = up16 ? v[i + 4] : v[i];
        a[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float send = up8 ? a[i] : a[i + 2], keep = up8 ? a[i + 2] : a[i];
        b[i] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
    }
    float send = up4 ? b[0] : b[1], keep = up4 ? b[1] : b[0];
    float r = keep + __shfl_xor_sync(0xffffffffu, send, 4);
    r += __shfl_xor_sync(0xffffffffu, r, 2);
    return r + __shfl_xor_sync(0xffffffffu, r, 1);
}

// Dynamic shared memory: per warp ATTN_STAGES runs of ATTN_POS positions × (K lo, K hi, V lo,
// V hi) × 32 lanes float4s; after the loop the same memory holds the warps' accumulators
// [8 warps][ATTN_GQA heads][ATTN_DMAX] for the merge.
extern "C" __global__ void __launch_bounds__(256, 1) attn_partial(const float* q, const float* k_cache,
                                                                  const float* v_cache, const int* __restrict__ pos_arr,
                                                                  float* __restrict__ part_o, float* __restrict__ part_ml,
                                                                  int Hq, int Hkv, int D, int S, float scale,
                                                                  const int* __restrict__ slots, long long T,
                                                                  int row_pos) {
    // Slots and positions change only between steps (never in the kernel before).
    const int b = blockIdx.z, slot = slots[b];
    const int L = pos_arr[slot] + (row_pos ? b : 0) + 1;
    const int used = attn_splits(L, S);
    if (blockIdx.y >= used) return;
    extern __shared__ __align__(16) float4 attn_smem[];
    __shared__ float wm[8][ATTN_GQA], wl[8][ATTN_GQA];
    const int G = Hq / Hkv, hg = (G + ATTN_GQA - 1) / ATTN_GQA;
    const int kvh = blockIdx.x / hg, h0 = kvh * G + (blockIdx.x % hg) * ATTN_GQA;
    const int nh = min(ATTN_GQA, kvh * G + G - h0), s = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long row = (long long)Hkv * D;
    k_cache += slot * T * row + (long long)kvh * D;
    v_cache += slot * T * row + (long long)kvh * D;
    const int c = (L + used - 1) / used;
    const int start = s * c, end = min(L, start + c);
    const bool ok0 = attn_dims(0, lane, D), ok1 = attn_dims(1, lane, D);
    // The last position's K and V are the token's own, written by the kernel before (attn_prep):
    // read from global memory after the wait. Earlier rows were written by earlier steps.
    const int last = L - 1;
    float4* stages = attn_smem + warp * ATTN_STAGES * ATTN_POS * 128;
    auto issue = [&](int r) {
        const int p0 = start + (warp + 8 * r) * ATTN_POS;
        float4* st = stages + (r % ATTN_STAGES) * ATTN_POS * 128;
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            const int p = p0 + u;
            const bool in = p < end && p != last;
            const long long at = in ? (long long)p * row : 0;
            cp_async16(st + (4 * u) * 32 + lane, k_cache + at + 4 * lane, in && ok0);
            cp_async16(st + (4 * u + 1) * 32 + lane, k_cache + at + 128 + 4 * lane, in && ok1);
            cp_async16(st + (4 * u + 2) * 32 + lane, v_cache + at + 4 * lane, in && ok0);
            cp_async16(st + (4 * u + 3) * 32 + lane, v_cache + at + 128 + 4 * lane, in && ok1);
        }
        cp_async_commit();
    };
    // Rows of one sequence at consecutive positions (row_pos) find the rows before their own
    // written by the kernel before too: their copies wait for it.
    if (row_pos) pdl_entry();
#pragma unroll
    for (int r = 0; r < ATTN_STAGES - 1; ++r) issue(r);
    if (!row_pos) pdl_entry();
    q += ((long long)b * Hq + h0) * D;
    float qr[ATTN_GQA][8], acc[ATTN_GQA][8];
#pragma unroll
    for (int j = 0; j < ATTN_GQA; ++j) {
        const bool hj = j < nh;
        attn_load_row(q + (long long)j * D, lane, hj && ok0, hj && ok1, qr[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
    }
    // The online softmax of head lane >> 2 (its four lanes hold the same values).
    float m = NEG_INF, l = 0.f;
    for (int r = 0;; ++r) {
        const int p0 = start + (warp + 8 * r) * ATTN_POS;
        if (p0 >= end) break;
        issue(r + ATTN_STAGES - 1);
        cp_async_wait_group<ATTN_STAGES - 1>();
        const float4* st = stages + (r % ATTN_STAGES) * ATTN_POS * 128;
        float kv[ATTN_POS][8], vv[ATTN_POS][8];
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            if (p0 + u == last) {
                attn_load_row(k_cache + (long long)last * row, lane, ok0, ok1, kv[u]);
                attn_load_row(v_cache + (long long)last * row, lane, ok0, ok1, vv[u]);
            } else {
                attn_unpack(st[(4 * u) * 32 + lane], st[(4 * u + 1) * 32 + lane], kv[u]);
                attn_unpack(st[(4 * u + 2) * 32 + lane], st[(4 * u + 3) * 32 + lane], vv[u]);
            }
        }
        float sc[ATTN_POS], mn = m;
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            float dot[ATTN_GQA];
#pragma unroll
            for (int j = 0; j < ATTN_GQA; ++j) {
                dot[j] = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot[j] = fmaf(qr[j][i], kv[u][i], dot[j]);
            }
            sc[u] = p0 + u < end ? attn_reduce_heads(dot, lane) * scale : NEG_INF;
            mn = fmaxf(mn, sc[u]);
        }
        const float corr = expf(m - mn);
        l *= corr;
        float e[ATTN_POS];
#pragma unroll
        for (int u = 0; u < ATTN_POS; ++u) {
            e[u] = expf(sc[u] - mn);
            l += e[u];
        }
        m = mn;
#pragma unroll
        for (int j = 0; j < ATTN_GQA; ++j) {
            const float cj = __shfl_sync(0xffffffffu, corr, 4 * j);
            float ej[ATTN_POS];
#pragma unroll
            for (int u = 0; u < ATTN_POS; ++u) ej[u] = __shfl_sync(0xffffffffu, e[u], 4 * j);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float a = acc[j][i] * cj;
#pragma unroll
                for (int u = 0; u < ATTN_POS; ++u) a = fmaf(ej[u], vv[u][i], a);
                acc[j][i] = a;
            }
        }
    }
    // The warps meet: each leaves its accumulators and (m, l) per head, then warp j merges head
    // j with weights e^{m_w − M} (empty warps weigh 0).
    cp_async_wait_all();
    __syncthreads();
    float* wacc = reinterpret_cast<float*>(attn_smem);
    if ((lane & 3) == 0) {
        wm[warp][lane >> 2] = m;
        wl[warp][lane >> 2] = l;
    }
#pragma unroll
    for (int j = 0; j < ATTN_GQA; ++j) {
        float* dst = wacc + (warp * ATTN_GQA + j) * ATTN_DMAX;
        if (ok0) *reinterpret_cast<float4*>(dst + 4 * lane) = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
        if (ok1) *reinterpret_cast<float4*>(dst + 128 + 4 * lane) = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
    }
    __syncthreads();
    const int j = warp;
    if (j >= nh) return;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < 8; ++w)
        if (wl[w][j] > 0.f) M = fmaxf(M, wm[w][j]);
    float f[8], Ls = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        f[w] = wl[w][j] > 0.f ? expf(wm[w][j] - M) : 0.f;
        Ls += wl[w][j] * f[w];
    }
    const long long idx = ((long long)b * Hq + h0 + j) * S + s;
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
        if (!attn_dims(cc, lane, D)) continue;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const float4 a = *reinterpret_cast<const float4*>(wacc + (w * ATTN_GQA + j) * ATTN_DMAX + 128 * cc + 4 * lane);
            o = make_float4(fmaf(a.x, f[w], o.x), fmaf(a.y, f[w], o.y), fmaf(a.z, f[w], o.z), fmaf(a.w, f[w], o.w));
        }
        *reinterpret_cast<float4*>(part_o + idx * D + 128 * cc + 4 * lane) = o;
    }
    if (lane == 0) {
        part_ml[idx * 2] = M;
        part_ml[idx * 2 + 1] = Ls;
    }
}

#define ATTN_MAX_SPLITS 256
// Splits whose partial outputs attn_combine loads up front (every split up to 256 positions).
#define ATTN_COMBINE_REGS 16

extern "C" __global__ void attn_combine(const float* part_o, const float* part_ml,
                                        const float* proj, float* __restrict__ out,
                                        int D, int S, int Hq, long long P,
                                        const int* __restrict__ pos_arr, const int* __restrict__ slots,
                                        int row_pos) {
    int h = blockIdx.x, d = threadIdx.x;
    int row = blockIdx.y;
    const int used = attn_splits(pos_arr[slots[row]] + (row_pos ? row : 0) + 1, S);
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
    // The first ATTN_COMBINE_REGS splits' partial outputs are loaded now, with the gate and the
    // splits' (m, l), so that the weighted sum below waits on no second round trip to L2.
    const float* po = part_o + (long long)h * S * D + d;
    float pv[ATTN_COMBINE_REGS];
#pragma unroll
    for (int s = 0; s < ATTN_COMBINE_REGS; ++s) pv[s] = d < D && s < used ? po[(long long)s * D] : 0.f;
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
#pragma unroll
    for (int s = 0; s < ATTN_COMBINE_REGS; ++s)
        if (s < used) num = fmaf(pv[s], wts[s], num);
#pragma unroll 8
    for (int s = ATTN_COMBINE_REGS; s < used; ++s) num = fmaf(po[(long long)s * D], wts[s], num);
    out[(long long)h * D + d] = num / den * sigmoid_f(gate);
}
