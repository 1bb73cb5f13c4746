// Matrix-vector products of one matrix with a batch of B input rows (batched decode): every
// weight a warp loads serves up to MV_VECS rows, so the matrix is read and dequantized once per
// MV_VECS rows instead of once per row. Activations f32.
//
// matvec_rows_bf16: y[b, n] = Σ_k W[n, k] · x[b, k] (+ bias[n]); W: [N, K] bf16 (K % 8 == 0);
//   x: row b at x + b·x_stride; y: [B, N]. grid (ceil(B / MV_VECS), ceil(N / 8)), block 256: a
//   warp per output row n and group of MV_VECS rows; lane l loads weights 8l.., 8l + 256.., ….
// matvec_rows_affine: the same on an MLX affine matrix (words u32 [N, K·bits/32], LSB first;
//   scales, biases bf16 [N, K/G]; bits 2, 4 or 8), FMA dequant form per word and row b:
//   acc += scale·Σ q·x_b + bias·Σ x_b. Lane l reads words l, l + 32, … (128-byte warp loads).
// swiglu_rows_bf16 / swiglu_rows_affine: h[b, n] = silu(G[n]·x_b) · U[n]·x_b for W = [gate (I rows)
//   | up (I rows)]; h: [B, I]. Grids as above over I.

#define MV_VECS 8

// Σ_k w[k] x_v[k] for the nv ≤ MV_VECS vectors x + v·xs, one bf16 row w; warp-summed into acc.
__device__ __forceinline__ void dot_row_vecs(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                             long long xs, int nv, int K, int lane, float acc[MV_VECS]) {
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = 0.f;
    for (int k = lane * 8; k < K; k += 256) {
        uint4 p = __ldcs(reinterpret_cast<const uint4*>(w + k));
        float wf[8] = {bf16lo(p.x), bf16hi(p.x), bf16lo(p.y), bf16hi(p.y),
                       bf16lo(p.z), bf16hi(p.z), bf16lo(p.w), bf16hi(p.w)};
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) {
            if (v < nv) {
                const float* xr = x + v * xs + k;
                float4 xa = *reinterpret_cast<const float4*>(xr);
                float4 xb = *reinterpret_cast<const float4*>(xr + 4);
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

// The same for one affine row `row` (word and group indices of the matrix).
template <int BITS>
__device__ void dot_row_vecs_affine(const unsigned int* __restrict__ W, const bf16_t* __restrict__ S,
                                    const bf16_t* __restrict__ B, long long row, const float* __restrict__ x,
                                    long long xs, int nv, int K, int gshift, int lane, float acc[MV_VECS]) {
    const int V = 32 / BITS;
    const unsigned int mask = (1u << BITS) - 1u;
    const int nw = K / V;
    const long long gpr = K >> gshift;
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v) acc[v] = 0.f;
    for (int wi = lane; wi < nw; wi += 32) {
        unsigned int p = __ldcs(W + row * nw + wi);
        int k = wi * V;
        long long gi = row * gpr + (k >> gshift);
        float sc = bf16f(S[gi]), bi = bf16f(B[gi]);
        float q[V];
#pragma unroll
        for (int i = 0; i < V; ++i)
            q[i] = __uint_as_float(((p >> (i * BITS)) & mask) | 0x4B000000u) - 8388608.0f;
#pragma unroll
        for (int v = 0; v < MV_VECS; ++v) {
            if (v < nv) {
                const float* xr = x + v * xs + k;
                float qx = 0.f, sx = 0.f;
#pragma unroll
                for (int c = 0; c < V / 4; ++c) {
                    float4 f = *reinterpret_cast<const float4*>(xr + 4 * c);
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

extern "C" __global__ void matvec_rows_bf16(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                            float* __restrict__ y, int N, int K, int Bn, long long xs,
                                            const float* __restrict__ bias) {
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n >= N) return;
    float acc[MV_VECS];
    dot_row_vecs(W + (long long)n * K, x + b0 * xs, xs, nv, K, lane, acc);
    float add = bias ? bias[n] : 0.f;
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) y[(long long)(b0 + v) * N + n] = acc[v] + add;
}

extern "C" __global__ void swiglu_rows_bf16(const bf16_t* __restrict__ W, const float* __restrict__ x,
                                            float* __restrict__ h, int I, int K, int Bn, long long xs) {
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n >= I) return;
    float g[MV_VECS], u[MV_VECS];
    dot_row_vecs(W + (long long)n * K, x + b0 * xs, xs, nv, K, lane, g);
    dot_row_vecs(W + (long long)(I + n) * K, x + b0 * xs, xs, nv, K, lane, u);
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) h[(long long)(b0 + v) * I + n] = silu_f(g[v]) * u[v];
}

#define MVR_DISPATCH(CALL)                     \
    if (bits == 4) { const int BITS = 4; CALL; } \
    else if (bits == 8) { const int BITS = 8; CALL; } \
    else { const int BITS = 2; CALL; }

extern "C" __global__ void matvec_rows_affine(const unsigned int* __restrict__ W, const bf16_t* __restrict__ S,
                                              const bf16_t* __restrict__ B, const float* __restrict__ x,
                                              float* __restrict__ y, int N, int K, int G, int bits, int Bn,
                                              long long xs, const float* __restrict__ bias) {
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n >= N) return;
    float acc[MV_VECS];
    MVR_DISPATCH((dot_row_vecs_affine<BITS>(W, S, B, n, x + b0 * xs, xs, nv, K, __ffs(G) - 1, lane, acc)))
    float add = bias ? bias[n] : 0.f;
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) y[(long long)(b0 + v) * N + n] = acc[v] + add;
}

extern "C" __global__ void swiglu_rows_affine(const unsigned int* __restrict__ W, const bf16_t* __restrict__ S,
                                              const bf16_t* __restrict__ B, const float* __restrict__ x,
                                              float* __restrict__ h, int I, int K, int G, int bits, int Bn,
                                              long long xs) {
    int n = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    int b0 = blockIdx.x * MV_VECS, nv = min(MV_VECS, Bn - b0);
    if (n >= I) return;
    float g[MV_VECS], u[MV_VECS];
    const float* xb = x + b0 * xs;
    int gs = __ffs(G) - 1;
    MVR_DISPATCH((dot_row_vecs_affine<BITS>(W, S, B, n, xb, xs, nv, K, gs, lane, g)))
    MVR_DISPATCH((dot_row_vecs_affine<BITS>(W, S, B, (long long)I + n, xb, xs, nv, K, gs, lane, u)))
#pragma unroll
    for (int v = 0; v < MV_VECS; ++v)
        if (lane == v && v < nv) h[(long long)(b0 + v) * I + n] = silu_f(g[v]) * u[v];
}
