// Products against fine-grained FP8 weights on CUDA cores, activations f32 (exact: the value of
// every weight is e4m3(code) · scale, summed in f32 as the CPU's cpu::fp8 does up to order).
//
// Layout: codes u8 [E, N, K] (e4m3, K % 8 == 0), scales f32 [E, N, ceil(K / G)]: the checkpoint's
// scale of each 128 × 128 block copied to every row it covers, so that a row holds one scale per
// G inputs (G % 8 == 0). Every kernel takes the affine kernels' arguments (W, S, B, ..., G, bits)
// so that one marshalling serves both; B and bits are unused.
//
// Per lane, 8 codes (one 8-byte load) at k = 8·lane + 256·j, decoded exactly, dotted with x and
// scaled once: acc += S[n, k / G] · Σ_8 e4m3(W[n, k + i]) · x[k + i].
//
// matvec_rows_fp8 / swiglu_rows_fp8: a batch of B rows through one matrix, as matvec_rows_bf16
//   and swiglu_rows_bf16 (matvec_rows.cu): grid (ceil(B / MV_VECS), ceil(N / (8·MV_ROWS)))
//   (SwiGLU: ceil(I / (8·MV_ROWS/2))), block 256.
// grouped_rows_fp8 / grouped_swiglu_fp8: expert pairs grouped by expert, as grouped_rows_bf16:
//   grid (tiles, ceil(N / 8)), block 256, one warp a row for the tile's ≤ MV_VECS pairs.
// matvec_fp8 / matvec_swiglu_fp8: slots picking matrices by id, as matvec_bf16 (matvec.cu):
//   grid (S, ceil(N / 8)) (SwiGLU: ceil(I / 8)), block 256, one warp a row; ids < 0 skipped,
//   ids ≥ split read the far stack (Wf, Sf). One matrix for one row (no ids, S = 1): the first
//   blocks ask L2 for their rows before waiting on the kernel before (H100, 35B: batch-1 decode
//   +3.5%; batches of 8 and 32, whose expert slots run these kernels, about 2% slower).

#define MV_VECS 8
#define MV_ROWS 4

// The 8 codes of p, decoded.
__device__ __forceinline__ void e4m3x8(uint2 p, float w[8]) {
    e4m3x4(p.x, w);
    e4m3x4(p.y, w + 4);
}

__device__ __forceinline__ float dot8f(const float w[8], const float* x) {
    const float4 a = *reinterpret_cast<const float4*>(x), b = *reinterpret_cast<const float4*>(x + 4);
    float s = w[0] * a.x;
    s = fmaf(w[1], a.y, s);
    s = fmaf(w[2], a.z, s);
    s = fmaf(w[3], a.w, s);
    s = fmaf(w[4], b.x, s);
    s = fmaf(w[5], b.y, s);
    s = fmaf(w[6], b.z, s);
    return fmaf(w[7], b.w, s);
}

// acc[r][v] = Σ_k W[rows[r], k] x_v[k] for the nv ≤ MV_VECS inputs x + v·xs, warp-summed.
__device__ void fp8_rows_vecs(const unsigned char* __restrict__ W, const float* __restrict__ S,
                              const long long rows[MV_ROWS], const float* x, long long xs, int nv, int K,
                              int G, int lane, float acc[MV_ROWS][MV_VECS]) {
    const int KG = (K + G - 1) / G;
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) acc[r][v] = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
        float wf[MV_ROWS][8], sc[MV_ROWS];
#pragma unroll
        for (int r = 0; r < MV_ROWS; ++r) {
            e4m3x8(__ldcs(reinterpret_cast<const uint2*>(W + rows[r] * K + k)), wf[r]);
            sc[r] = S[rows[r] * KG + k / G];
        }
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (v < nv)
#pragma unroll
                for (int r = 0; r < MV_ROWS; ++r) acc[r][v] = fmaf(sc[r], dot8f(wf[r], x + v * xs + k), acc[r][v]);
    }
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) acc[r][v] = warp_sum(acc[r][v]);
}

// acc[v] = Σ_k W[row, k] xr[v][k] for nv ≤ MV_VECS inputs at their own addresses, warp-summed.
__device__ void fp8_row_gather(const unsigned char* __restrict__ W, const float* __restrict__ S, long long row,
                               const float* const* xr, int nv, int K, int G, int lane, float acc[MV_VECS]) {
    const int KG = (K + G - 1) / G;
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
        float wf[8];
        e4m3x8(__ldg(reinterpret_cast<const uint2*>(W + row * K + k)), wf);
        const float sc = S[row * KG + k / G];
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (v < nv) acc[v] = fmaf(sc, dot8f(wf, xr[v] + k), acc[v]);
    }
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = warp_sum(acc[v]);
}

extern "C" __global__ void matvec_rows_fp8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                           const void* B, const float* x, float* __restrict__ y, int N, int K,
                                           int G, int bits, int Bn, long long xs, const float* __restrict__ bias) {
    pdl_entry();
    const int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * MV_ROWS, lane = threadIdx.x & 31;
    const int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n0 >= N) return;
    long long rows[MV_ROWS];
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r) rows[r] = min(n0 + r, N - 1);
    float acc[MV_ROWS][MV_VECS];
    fp8_rows_vecs(W, S, rows, x + b0 * xs, xs, nv, K, G, lane, acc);
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (lane == r * MV_VECS + v && v < nv && n0 + r < N)
                y[(long long)(b0 + v) * N + n0 + r] = acc[r][v] + (bias ? bias[n0 + r] : 0.f);
}

extern "C" __global__ void swiglu_rows_fp8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                           const void* B, const float* x, float* __restrict__ h, int I, int K,
                                           int G, int bits, int Bn, long long xs) {
    pdl_entry();
    const int NPW = MV_ROWS / 2;
    const int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * NPW, lane = threadIdx.x & 31;
    const int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n0 >= I) return;
    long long rows[MV_ROWS];
#pragma unroll
    for (int r = 0; r < NPW; ++r) {
        rows[r] = min(n0 + r, I - 1);
        rows[NPW + r] = (long long)I + rows[r];
    }
    float acc[MV_ROWS][MV_VECS];
    fp8_rows_vecs(W, S, rows, x + b0 * xs, xs, nv, K, G, lane, acc);
#pragma unroll
    for (int r = 0; r < NPW; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (lane == r * MV_VECS + v && v < nv && n0 + r < I)
                h[(long long)(b0 + v) * I + n0 + r] = silu_f(acc[r][v]) * acc[NPW + r][v];
}

// The tile of this block (int3 tiles: expert, first index into order, count ≤ MV_VECS): its
// expert, pair count, pairs and input row addresses; false when the block has none.
__device__ __forceinline__ bool fp8_tile(const int* tiles, const int* n_tiles, const int* order, const float* x,
                                         long long xs, int x_div, int& e, int& nv, int pair[MV_VECS],
                                         const float* xr[MV_VECS]) {
    const int ti = blockIdx.x;
    if (ti >= n_tiles[0]) return false;
    e = tiles[3 * ti];
    const int f = tiles[3 * ti + 1];
    nv = tiles[3 * ti + 2];
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) {
        pair[v] = v < nv ? order[f + v] : 0;
        xr[v] = x + (long long)(pair[v] / x_div) * xs;
    }
    return true;
}

extern "C" __global__ void grouped_rows_fp8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                            const void* B, const float* x, float* __restrict__ y, int N, int K,
                                            int G, int bits, const int* tiles, const int* n_tiles,
                                            const int* order, long long xs, int x_div) {
    pdl_entry();
    const int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int e, nv, pair[MV_VECS];
    const float* xr[MV_VECS];
    if (n >= N || !fp8_tile(tiles, n_tiles, order, x, xs, x_div, e, nv, pair, xr)) return;
    float acc[MV_VECS];
    fp8_row_gather(W, S, (long long)e * N + n, xr, nv, K, G, lane, acc);
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) y[(long long)pair[v] * N + n] = acc[v];
}

extern "C" __global__ void grouped_swiglu_fp8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                              const void* B, const float* x, float* __restrict__ h, int I, int K,
                                              int G, int bits, const int* tiles, const int* n_tiles,
                                              const int* order, long long xs, int x_div) {
    pdl_entry();
    const int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int e, nv, pair[MV_VECS];
    const float* xr[MV_VECS];
    if (n >= I || !fp8_tile(tiles, n_tiles, order, x, xs, x_div, e, nv, pair, xr)) return;
    float g[MV_VECS], u[MV_VECS];
    const long long base = (long long)e * 2 * I;
    fp8_row_gather(W, S, base + n, xr, nv, K, G, lane, g);
    fp8_row_gather(W, S, base + I + n, xr, nv, K, G, lane, u);
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) h[(long long)pair[v] * I + n] = silu_f(g[v]) * u[v];
}

// Loads a lane has in flight in the slots kernels before using any: one row's 8-byte loads
// alone leave a warp waiting on each in turn.
#define FP8_UNROLL 4

// Σ_k W[row, k] x[k] over one row, warp-summed (the slots kernels).
__device__ __forceinline__ float fp8_row(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                         long long row, const float* x, int K, int G, int lane) {
    const int KG = (K + G - 1) / G;
    float acc = 0.f;
    for (int base = lane * 8; base < K; base += 256 * FP8_UNROLL) {
        uint2 p[FP8_UNROLL];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            const int k = base + 256 * u;
            if (k < K) p[u] = __ldcs(reinterpret_cast<const uint2*>(W + row * K + k));
        }
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; ++u) {
            const int k = base + 256 * u;
            if (k < K) {
                float wf[8];
                e4m3x8(p[u], wf);
                acc = fmaf(S[row * KG + k / G], dot8f(wf, x + k), acc);
            }
        }
    }
    return warp_sum(acc);
}

extern "C" __global__ void matvec_fp8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                      const void* B, const float* x, float* __restrict__ y, int N, int K, int G,
                                      const int* ids, long long x_stride, int x_div, const float* __restrict__ bias,
                                      const unsigned char* __restrict__ Wf, const float* __restrict__ Sf,
                                      const void* Bf, int split) {
    if (!ids && gridDim.x == 1) l2_prefetch_rows(W, blockIdx.y * 8LL, 8, N, K, blockIdx.y);
    pdl_entry();
    const int row = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31, s = blockIdx.x;
    if (row >= N) return;
    long long e = ids ? ids[s] : 0;
    if (e < 0) return;  // computed by the host (moe.cu, host experts)
    const long long b = e;
    if (e >= split) {
        W = Wf;
        S = Sf;
        e -= split;
    }
    float acc = fp8_row(W, S, e * N + row, x + (s / x_div) * x_stride, K, G, lane);
    if (bias) acc += bias[b * N + row];
    if (lane == 0) y[(long long)s * N + row] = acc;
}

extern "C" __global__ void matvec_swiglu_fp8(const unsigned char* __restrict__ W, const float* __restrict__ S,
                                             const void* B, const float* x, float* __restrict__ h, int I, int K,
                                             int G, const int* ids, long long x_stride, int x_div,
                                             const unsigned char* __restrict__ Wf, const float* __restrict__ Sf,
                                             const void* Bf, int split) {
    if (!ids && gridDim.x == 1) {
        l2_prefetch_rows(W, blockIdx.y * 8LL, 8, I, K, blockIdx.y);
        l2_prefetch_rows(W, I + blockIdx.y * 8LL, 8, 2LL * I, K, blockIdx.y);
    }
    pdl_entry();
    const int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31, s = blockIdx.x;
    if (n >= I) return;
    long long e = ids ? ids[s] : 0;
    if (e < 0) return;  // computed by the host (moe.cu, host experts)
    if (e >= split) {
        W = Wf;
        S = Sf;
        e -= split;
    }
    const float* xs = x + (s / x_div) * x_stride;
    const float g = fp8_row(W, S, e * 2LL * I + n, xs, K, G, lane);
    const float u = fp8_row(W, S, e * 2LL * I + I + n, xs, K, G, lane);
    if (lane == 0) h[(long long)s * I + n] = silu_f(g) * u;
}
