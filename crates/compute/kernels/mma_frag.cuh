// Tensor-core fragments of the batched products (mma_rows.cu, mma_wide.cu; prefixed to both):
// y[b, n] = Σ_k W[n, k] x[b, k] (+ bias[n]) at about f32 accuracy.
//
// mma.sync m16n8k16 (bf16 in, f32 accumulate) with A = 16 weight rows, B = 8 input rows. The
// weights enter exactly: bf16 matrices as they are, MLX affine 4/8-bit ones as their integer
// codes q (exact in bf16), with the FMA dequant form applied per group of G inputs:
// Σ_k w x = scale·Σ_k q x + bias·Σ_k x. Each input x is split into x_hi = bf16(x) and
// x_lo = bf16(x − x_hi), two products per tile, so the inputs keep ~16 significant bits.
//
// Layouts: W bf16 [N, K], or affine words u32 [N, K·bits/32] (LSB first) with scales and biases
// bf16 [N, K/G] (built with AFFINE_F16_ZERO: f16 scales and zero points; with AFFINE_F32: f32
// scales and biases; common.cuh's aff_t, aff_scale),
// G ∈ {32, 64, 128} (and 16, below); x: row b at x + b·x_stride (16-byte aligned); y: [B, N];
// K % 32 == 0. SwiGLU form: W = [gate (I rows) | up (I rows)], h[b, n] = silu(G_n·x_b)·U_n·x_b,
// h: [B, I].
//
// Accumulator fragments (mma C layout): lane l holds rows l/4 and l/4 + 8 of its warp's 16
// weight rows, inputs 2(l%4) and 2(l%4) + 1 of each 8-row tile. Groups hold whole chunks of 32,
// or, for 8-bit codes in the AFFINE_F32 build (GGUF's Q6_K), G = 16: then each k16 step holds
// one group (the kernels' headers say how a lane's values map to k) and the dequant form is
// applied after each step.

#define MMA_TILES 4

// The sums of a quad's values (lanes 4i .. 4i + 3 each hold a part of row i's) for the inputs
// 2t and 2t + 1 of an mma C fragment (t = lane % 4): x0, x1.
__device__ __forceinline__ void quad_sums(float v, float& x0, float& x1) {
    const int t = threadIdx.x & 3;
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    x0 = __shfl_sync(0xffffffffu, v, (2 * t) * 4);
    x1 = __shfl_sync(0xffffffffu, v, (2 * t + 1) * 4);
}

// Zeroes a warp's fragments and group partials.
template <int SETS, int MT>
__device__ __forceinline__ void zero_frags(float acc[SETS][MT][4], float part[SETS][MT][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[s][j][e] = part[s][j][e] = 0.f;
}

// The FMA dequant form for tile j: acc += scale·Σ q x + bias·Σ x for each (row, input) of the
// fragment (x0, x1: the sums of its inputs 2t and 2t + 1), then the partials restart.
template <int SETS, int MT>
__device__ __forceinline__ void flush_tile(const float sc[SETS][2], const float bi[SETS][2], float x0, float x1,
                                           int j, float acc[SETS][MT][4], float part[SETS][MT][4]) {
#pragma unroll
    for (int s = 0; s < SETS; ++s) {
        float* A = acc[s][j];
        float* P = part[s][j];
        A[0] = fmaf(sc[s][0], P[0], fmaf(bi[s][0], x0, A[0]));
        A[1] = fmaf(sc[s][0], P[1], fmaf(bi[s][0], x1, A[1]));
        A[2] = fmaf(sc[s][1], P[2], fmaf(bi[s][1], x0, A[2]));
        A[3] = fmaf(sc[s][1], P[3], fmaf(bi[s][1], x1, A[3]));
        P[0] = P[1] = P[2] = P[3] = 0.f;
    }
}

// Writes a warp's fragments: output row n (< N) of input b (< nb) goes to y[out_row(b)·N + n];
// with SETS 2 the value is silu(set 0)·set 1.
template <int SETS, int MT>
__device__ __forceinline__ void store_frags(float acc[SETS][MT][4], float* y, int N, int r, int nb,
                                            const int* out_rows, int b0, const float* bias) {
    int lane = threadIdx.x & 31, gid = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int n = r + gid + (e >= 2 ? 8 : 0), b = j * 8 + 2 * t + (e & 1);
            if (n < N && b < nb) {
                float v = SETS == 2 ? silu_f(acc[0][j][e]) * acc[SETS - 1][j][e] : acc[0][j][e];
                long long o = out_rows ? out_rows[b] : b0 + b;
                y[o * N + n] = v + (bias ? bias[n] : 0.f);
            }
        }
}

