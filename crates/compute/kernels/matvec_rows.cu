// Matrix-vector products of one matrix with a batch of B input rows (batched decode, prefill):
// every weight a warp loads serves up to MV_VECS input rows, and every input value it loads
// serves MV_ROWS weight rows, so the matrix is read and dequantized once per MV_VECS inputs.
// Activations f32.
//
// matvec_rows_bf16: y[b, n] = Σ_k W[n, k] · x[b, k] (+ bias[n]); W: [N, K] bf16 (K % 8 == 0);
//   x: row b at x + b·x_stride; y: [B, N]. grid (ceil(B / MV_VECS), ceil(N / (8·MV_ROWS))),
//   block 256: warp w computes rows (blockIdx.y·8 + w)·MV_ROWS + 0..MV_ROWS for MV_VECS inputs;
//   lane l loads weights 8l.., 8l + 256.., … of each row.
// matvec_rows_affine: the same on an MLX affine matrix (words u32 [N, K·bits/32], LSB first;
//   scales, biases bf16 [N, K/G]; bits 2, 4 or 8), FMA dequant form per word, row and input b:
//   acc += scale·Σ q·x_b + bias·Σ x_b. Lane l reads words l, l + 32, … (128-byte warp loads).
//   Built with AFFINE_F16_ZERO: f16 scales and zero points; with AFFINE_F32: f32 scales and
//   biases (common.cuh, aff_t, aff_scale and aff_bias).
// swiglu_rows_bf16 / swiglu_rows_affine: h[b, n] = silu(G[n]·x_b) · U[n]·x_b for W = [gate (I rows)
//   | up (I rows)]; h: [B, I]. A warp computes MV_ROWS/2 outputs (their gate and up rows);
//   grid (ceil(B / MV_VECS), ceil(I / (8·MV_ROWS/2))).

#define MV_VECS 8
#define MV_ROWS 4

// acc[r][v] = Σ_k W[rows[r], k] x_v[k] for the nv ≤ MV_VECS inputs x + v·xs (bf16 rows of K),
// warp-summed.
__device__ __forceinline__ void dot_rows_vecs(const bf16_t* __restrict__ W, const long long rows[MV_ROWS],
                                              const float* x, long long xs, int nv, int K,
                                              int lane, float acc[MV_ROWS][MV_VECS]) {
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) acc[r][v] = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
        float wf[MV_ROWS][8];
#pragma unroll
        for (int r = 0; r < MV_ROWS; ++r) {
            uint4 p = __ldcs(reinterpret_cast<const uint4*>(W + rows[r] * K + k));
            wf[r][0] = bf16lo(p.x); wf[r][1] = bf16hi(p.x);
            wf[r][2] = bf16lo(p.y); wf[r][3] = bf16hi(p.y);
            wf[r][4] = bf16lo(p.z); wf[r][5] = bf16hi(p.z);
            wf[r][6] = bf16lo(p.w); wf[r][7] = bf16hi(p.w);
        }
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) {
            if (v < nv) {
                const float* xr = x + v * xs + k;
                float4 xa = *reinterpret_cast<const float4*>(xr);
                float4 xb = *reinterpret_cast<const float4*>(xr + 4);
                float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
                for (int r = 0; r < MV_ROWS; ++r) {
                    float a = acc[r][v];
#pragma unroll
                    for (int i = 0; i < 8; ++i) a = fmaf(wf[r][i], xv[i], a);
                    acc[r][v] = a;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) acc[r][v] = warp_sum(acc[r][v]);
}

// The same for affine rows (row indices into the words, scales and biases of the matrix).
template <int BITS>
__device__ void dot_rows_vecs_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                     const aff_t* __restrict__ B, const long long rows[MV_ROWS],
                                     const float* x, long long xs, int nv, int K, int gshift,
                                     int lane, float acc[MV_ROWS][MV_VECS]) {
    const int V = 32 / BITS;
    const unsigned int mask = (1u << BITS) - 1u;
    const int nw = K / V;
    const long long gpr = K >> gshift;
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) acc[r][v] = 0.f;
    for (int wi = lane; wi < nw; wi += 32) {
        int k = wi * V;
        // Dequantize each row's word once (q as floats; scale and bias applied per input).
        float q[MV_ROWS][V], sc[MV_ROWS], bi[MV_ROWS];
#pragma unroll
        for (int r = 0; r < MV_ROWS; ++r) {
            unsigned int p = __ldcs(W + rows[r] * nw + wi);
            long long gi = rows[r] * gpr + (k >> gshift);
            sc[r] = aff_scale(S[gi]);
            bi[r] = aff_bias(B[gi], sc[r]);
#pragma unroll
            for (int i = 0; i < V; ++i)
                q[r][i] = __uint_as_float(((p >> (i * BITS)) & mask) | 0x4B000000u) - 8388608.0f;
        }
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) {
            if (v < nv) {
                const float* xr = x + v * xs + k;
                float xv[V];
                float sx = 0.f;
#pragma unroll
                for (int c = 0; c < V / 4; ++c) {
                    float4 f = *reinterpret_cast<const float4*>(xr + 4 * c);
                    xv[4 * c] = f.x;
                    xv[4 * c + 1] = f.y;
                    xv[4 * c + 2] = f.z;
                    xv[4 * c + 3] = f.w;
                    sx += (f.x + f.y) + (f.z + f.w);
                }
#pragma unroll
                for (int r = 0; r < MV_ROWS; ++r) {
                    float qx = 0.f;
#pragma unroll
                    for (int i = 0; i < V; ++i) qx = fmaf(q[r][i], xv[i], qx);
                    acc[r][v] = fmaf(sc[r], qx, fmaf(bi[r], sx, acc[r][v]));
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) acc[r][v] = warp_sum(acc[r][v]);
}

// Rows of the warp's group (clamped to the last row; the extra results are not stored).
__device__ __forceinline__ void warp_rows(int n0, int N, long long base, long long rows[MV_ROWS]) {
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r) rows[r] = base + min(n0 + r, N - 1);
}

#define MVR_DISPATCH(CALL)                                \
    if (bits == 4) { const int BITS = 4; CALL; }          \
    else if (bits == 8) { const int BITS = 8; CALL; }     \
    else { const int BITS = 2; CALL; }

extern "C" __global__ void matvec_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                            float* __restrict__ y, int N, int K, int Bn, long long xs,
                                            const float* __restrict__ bias) {
    pdl_entry();
    int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * MV_ROWS, lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n0 >= N) return;
    long long rows[MV_ROWS];
    warp_rows(n0, N, 0, rows);
    float acc[MV_ROWS][MV_VECS];
    dot_rows_vecs(W, rows, x + b0 * xs, xs, nv, K, lane, acc);
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (lane == r * MV_VECS + v && v < nv && n0 + r < N)
                y[(long long)(b0 + v) * N + n0 + r] = acc[r][v] + (bias ? bias[n0 + r] : 0.f);
}

extern "C" __global__ void matvec_rows_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                              const aff_t* __restrict__ B, const float* x,
                                              float* __restrict__ y, int N, int K, int G, int bits, int Bn,
                                              long long xs, const float* __restrict__ bias) {
    pdl_entry();
    int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * MV_ROWS, lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n0 >= N) return;
    long long rows[MV_ROWS];
    warp_rows(n0, N, 0, rows);
    float acc[MV_ROWS][MV_VECS];
    MVR_DISPATCH((dot_rows_vecs_affine<BITS>(W, S, B, rows, x + b0 * xs, xs, nv, K, __ffs(G) - 1, lane, acc)))
#pragma unroll
    for (int r = 0; r < MV_ROWS; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (lane == r * MV_VECS + v && v < nv && n0 + r < N)
                y[(long long)(b0 + v) * N + n0 + r] = acc[r][v] + (bias ? bias[n0 + r] : 0.f);
}

// Rows of a SwiGLU warp: outputs n0..n0 + MV_ROWS/2 (clamped), gate rows first, then up rows.
__device__ __forceinline__ void swiglu_rows(int n0, int I, long long rows[MV_ROWS]) {
#pragma unroll
    for (int r = 0; r < MV_ROWS / 2; ++r) {
        int n = min(n0 + r, I - 1);
        rows[r] = n;
        rows[MV_ROWS / 2 + r] = (long long)I + n;
    }
}

extern "C" __global__ void swiglu_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                            float* __restrict__ h, int I, int K, int Bn, long long xs) {
    pdl_entry();
    const int NPW = MV_ROWS / 2;
    int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * NPW, lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n0 >= I) return;
    long long rows[MV_ROWS];
    swiglu_rows(n0, I, rows);
    float acc[MV_ROWS][MV_VECS];
    dot_rows_vecs(W, rows, x + b0 * xs, xs, nv, K, lane, acc);
#pragma unroll
    for (int r = 0; r < NPW; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (lane == r * MV_VECS + v && v < nv && n0 + r < I)
                h[(long long)(b0 + v) * I + n0 + r] = silu_f(acc[r][v]) * acc[NPW + r][v];
}

extern "C" __global__ void swiglu_rows_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                              const aff_t* __restrict__ B, const float* x,
                                              float* __restrict__ h, int I, int K, int G, int bits, int Bn,
                                              long long xs) {
    pdl_entry();
    const int NPW = MV_ROWS / 2;
    int n0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * NPW, lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n0 >= I) return;
    long long rows[MV_ROWS];
    swiglu_rows(n0, I, rows);
    float acc[MV_ROWS][MV_VECS];
    MVR_DISPATCH((dot_rows_vecs_affine<BITS>(W, S, B, rows, x + b0 * xs, xs, nv, K, __ffs(G) - 1, lane, acc)))
#pragma unroll
    for (int r = 0; r < NPW; ++r)
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v)
            if (lane == r * MV_VECS + v && v < nv && n0 + r < I)
                h[(long long)(b0 + v) * I + n0 + r] = silu_f(acc[r][v]) * acc[NPW + r][v];
}

// As dot_row_vecs with each input row at its own address xr[v] (16-byte aligned).
__device__ __forceinline__ void dot_row_gather(const bf16_t* __restrict__ w, const float* const* xr, int nv,
                                               int K, int lane, float acc[MV_VECS]) {
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
        uint4 p = __ldg(reinterpret_cast<const uint4*>(w + k));
        float wf[8] = {bf16lo(p.x), bf16hi(p.x), bf16lo(p.y), bf16hi(p.y),
                       bf16lo(p.z), bf16hi(p.z), bf16lo(p.w), bf16hi(p.w)};
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) {
            if (v < nv) {
                float4 xa = *reinterpret_cast<const float4*>(xr[v] + k);
                float4 xb = *reinterpret_cast<const float4*>(xr[v] + k + 4);
                float a = acc[v];
                a = fmaf(wf[0], xa.x, a);
                a = fmaf(wf[1], xa.y, a);
                a = fmaf(wf[2], xa.z, a);
                a = fmaf(wf[3], xa.w, a);
                a = fmaf(wf[4], xb.x, a);
                a = fmaf(wf[5], xb.y, a);
                a = fmaf(wf[6], xb.z, a);
                acc[v] = fmaf(wf[7], xb.w, a);
            }
        }
    }
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = warp_sum(acc[v]);
}

// As dot_row_vecs_affine with each input row at its own address xr[v].
template <int BITS>
__device__ void dot_row_gather_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                      const aff_t* __restrict__ B, long long row, const float* const* xr,
                                      int nv, int K, int gshift, int lane, float acc[MV_VECS]) {
    const int V = 32 / BITS;
    const unsigned int mask = (1u << BITS) - 1u;
    const int nw = K / V;
    const long long gpr = K >> gshift;
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = 0.f;
    for (int wi = lane; wi < nw; wi += 32) {
        unsigned int p = __ldg(W + row * nw + wi);
        int k = wi * V;
        long long gi = row * gpr + (k >> gshift);
        const float sc = aff_scale(S[gi]), bi = aff_bias(B[gi], sc);
        float q[V];
#pragma unroll
        for (int i = 0; i < V; ++i)
            q[i] = __uint_as_float(((p >> (i * BITS)) & mask) | 0x4B000000u) - 8388608.0f;
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) {
            if (v < nv) {
                const float* x = xr[v] + k;
                float qx = 0.f, sx = 0.f;
#pragma unroll
                for (int c = 0; c < V / 4; ++c) {
                    float4 f = *reinterpret_cast<const float4*>(x + 4 * c);
                    qx = fmaf(q[4 * c], f.x, qx);
                    qx = fmaf(q[4 * c + 1], f.y, qx);
                    qx = fmaf(q[4 * c + 2], f.z, qx);
                    qx = fmaf(q[4 * c + 3], f.w, qx);
                    sx += (f.x + f.y) + (f.z + f.w);
                }
                acc[v] = fmaf(sc, qx, fmaf(bi, sx, acc[v]));
            }
        }
    }
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = warp_sum(acc[v]);
}

// The tile of this block: expert, pairs (−1 past the count) and input row addresses; false when
// the block has no tile.
__device__ __forceinline__ bool grouped_tile(const int* tiles, const int* n_tiles,
                                             const int* order, const float* x, long long xs,
                                             int x_div, int& e, int& nv, int pair[MV_VECS],
                                             const float* xr[MV_VECS]) {
    int ti = blockIdx.x;
    if (ti >= n_tiles[0]) return false;
    e = tiles[3 * ti];
    int f = tiles[3 * ti + 1];
    nv = tiles[3 * ti + 2];
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) {
        pair[v] = v < nv ? order[f + v] : 0;
        xr[v] = x + (long long)(pair[v] / x_div) * xs;
    }
    return true;
}

extern "C" __global__ void grouped_rows_bf16(const bf16_t* __restrict__ W, const float* x,
                                             float* __restrict__ y, int N, int K, const int* tiles,
                                             const int* n_tiles, const int* order,
                                             long long xs, int x_div) {
    pdl_entry();
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int e, nv, pair[MV_VECS];
    const float* xr[MV_VECS];
    if (n >= N || !grouped_tile(tiles, n_tiles, order, x, xs, x_div, e, nv, pair, xr)) return;
    float acc[MV_VECS];
    dot_row_gather(W + ((long long)e * N + n) * K, xr, nv, K, lane, acc);
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) y[(long long)pair[v] * N + n] = acc[v];
}

extern "C" __global__ void grouped_swiglu_bf16(const bf16_t* __restrict__ W, const float* x,
                                               float* __restrict__ h, int I, int K, const int* tiles,
                                               const int* n_tiles, const int* order,
                                               long long xs, int x_div) {
    pdl_entry();
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int e, nv, pair[MV_VECS];
    const float* xr[MV_VECS];
    if (n >= I || !grouped_tile(tiles, n_tiles, order, x, xs, x_div, e, nv, pair, xr)) return;
    float g[MV_VECS], u[MV_VECS];
    const bf16_t* base = W + (long long)e * 2 * I * K;
    dot_row_gather(base + (long long)n * K, xr, nv, K, lane, g);
    dot_row_gather(base + (long long)(I + n) * K, xr, nv, K, lane, u);
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) h[(long long)pair[v] * I + n] = silu_f(g[v]) * u[v];
}

extern "C" __global__ void grouped_rows_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                               const aff_t* __restrict__ B, const float* x,
                                               float* __restrict__ y, int N, int K, int G, int bits,
                                               const int* tiles, const int* n_tiles,
                                               const int* order, long long xs, int x_div) {
    pdl_entry();
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int e, nv, pair[MV_VECS];
    const float* xr[MV_VECS];
    if (n >= N || !grouped_tile(tiles, n_tiles, order, x, xs, x_div, e, nv, pair, xr)) return;
    float acc[MV_VECS];
    long long row = (long long)e * N + n;
    MVR_DISPATCH((dot_row_gather_affine<BITS>(W, S, B, row, xr, nv, K, __ffs(G) - 1, lane, acc)))
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) y[(long long)pair[v] * N + n] = acc[v];
}

extern "C" __global__ void grouped_swiglu_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                                 const aff_t* __restrict__ B, const float* x,
                                                 float* __restrict__ h, int I, int K, int G, int bits,
                                                 const int* tiles, const int* n_tiles,
                                                 const int* order, long long xs, int x_div) {
    pdl_entry();
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int e, nv, pair[MV_VECS];
    const float* xr[MV_VECS];
    if (n >= I || !grouped_tile(tiles, n_tiles, order, x, xs, x_div, e, nv, pair, xr)) return;
    float g[MV_VECS], u[MV_VECS];
    long long base = (long long)e * 2 * I;
    int gs = __ffs(G) - 1;
    MVR_DISPATCH((dot_row_gather_affine<BITS>(W, S, B, base + n, xr, nv, K, gs, lane, g)))
    MVR_DISPATCH((dot_row_gather_affine<BITS>(W, S, B, base + I + n, xr, nv, K, gs, lane, u)))
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) h[(long long)pair[v] * I + n] = silu_f(g[v]) * u[v];
}
