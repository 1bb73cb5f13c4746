// Matrix-vector products for decode, weights bf16 row-major, activations f32.
//
// matvec_bf16: y[s, n] = Σ_k W_e[n, k] · x_s[k] (+ bias[e·N + n] when bias is given)
//   W: [E, N, K] bf16 (E = 1 for a plain matrix); e = ids ? ids[s] : 0.
//   x_s = x + (s / x_div) · x_stride (x_stride 0: every slot reads the same x); y: [S, N].
//   Slots are a batch of rows through one matrix (ids null, x_div 1), K experts of one token
//   (ids, x_stride 0), or K experts of each of several tokens (x_div K).
//   grid (S, ceil(N / 8)), block 256: one warp per output row; the slots of one row block are
//   adjacent blocks, so a matrix read by several slots is mostly served from L2.
//   16-byte weight loads when K % 8 == 0. Without ids (one matrix), the blocks of slot 0 ask L2
//   for their rows before waiting on the kernel before (common.cuh, PREFETCH_BLOCKS).
//   Far experts: ids ≥ split name matrix ids − split of a second stack Wf (same layout; e.g. pinned
//   host memory read over PCIe for offloaded experts); split = INT_MAX when there is none.
//   Slots with ids < 0 are skipped (their output is left as it is: the host computes them).
//
// matvec_swiglu_bf16: h[s, n] = silu(Σ_k G_e[n, k] x_s[k]) · Σ_k U_e[n, k] x_s[k]
//   W: [E, 2I, K] with gate rows 0..I and up rows I..2I (the HF gate_up layout); h: [S, I].
//   Slots and inputs as matvec_bf16. grid (S, ceil(I / 8)), block 256: one warp per n computes
//   the gate and up dot products together.
//   silu is silu_portable (common.cuh): the host's cpu::gpu_twin computes these outputs bit for
//   bit, so routed experts can run on either side.

// Loads per lane in flight before any is used: enough bytes in flight to cover HBM latency.
#define MV_UNROLL 4

__device__ __forceinline__ float dot8(uint4 p, float4 xa, float4 xb, float acc) {
    acc = fmaf(bf16lo(p.x), xa.x, acc);
    acc = fmaf(bf16hi(p.x), xa.y, acc);
    acc = fmaf(bf16lo(p.y), xa.z, acc);
    acc = fmaf(bf16hi(p.y), xa.w, acc);
    acc = fmaf(bf16lo(p.z), xb.x, acc);
    acc = fmaf(bf16hi(p.z), xb.y, acc);
    acc = fmaf(bf16lo(p.w), xb.z, acc);
    return fmaf(bf16hi(p.w), xb.w, acc);
}

__device__ __forceinline__ float dot_row(const bf16_t* __restrict__ w, const float* x, int K, int lane) {
    float acc = 0.f;
    if ((K & 7) == 0) {
        for (int base = lane * 8; base < K; base += 256 * MV_UNROLL) {
            uint4 p[MV_UNROLL];
#pragma unroll
            for (int u = 0; u < MV_UNROLL; ++u) {
                int k = base + u * 256;
                if (k < K) p[u] = __ldcs(reinterpret_cast<const uint4*>(w + k));
            }
#pragma unroll
            for (int u = 0; u < MV_UNROLL; ++u) {
                int k = base + u * 256;
                if (k < K) {
                    float4 xa = *reinterpret_cast<const float4*>(x + k);
                    float4 xb = *reinterpret_cast<const float4*>(x + k + 4);
                    acc = dot8(p[u], xa, xb, acc);
                }
            }
        }
    } else {
        for (int k = lane; k < K; k += 32) acc = fmaf(bf16f(w[k]), x[k], acc);
    }
    return warp_sum(acc);
}

extern "C" __global__ void matvec_bf16(const bf16_t* __restrict__ W, const float* x,
                                       float* __restrict__ y, int N, int K,
                                       const int* ids, long long x_stride, int x_div,
                                       const float* __restrict__ bias, const bf16_t* __restrict__ Wf,
                                       int split) {
    if (!ids && blockIdx.x == 0) l2_prefetch_rows(W, blockIdx.y * 8LL, 8, N, K * 2LL, blockIdx.y);
    pdl_entry();
    int row = blockIdx.y * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int s = blockIdx.x;
    if (row >= N) return;
    long long e = ids ? ids[s] : 0;
    if (e < 0) return;  // computed by the host (moe.cu, host experts)
    if (e >= split) {
        W = Wf;
        e -= split;
    }
    const bf16_t* w = W + (e * N + row) * (long long)K;
    float acc = dot_row(w, x + (s / x_div) * x_stride, K, lane);
    if (bias) acc += bias[e * N + row];
    if (lane == 0) y[(long long)s * N + row] = acc;
}

extern "C" __global__ void matvec_swiglu_bf16(const bf16_t* __restrict__ W, const float* x,
                                              float* __restrict__ h, int I, int K,
                                              const int* ids, long long x_stride, int x_div,
                                              const bf16_t* __restrict__ Wf, int split) {
    if (!ids && blockIdx.x == 0) {
        l2_prefetch_rows(W, blockIdx.y * 8LL, 8, I, K * 2LL, blockIdx.y);
        l2_prefetch_rows(W, I + blockIdx.y * 8LL, 8, 2LL * I, K * 2LL, blockIdx.y);
    }
    pdl_entry();
    int n = blockIdx.y * 8 + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    int s = blockIdx.x;
    if (n >= I) return;
    long long e = ids ? ids[s] : 0;
    if (e < 0) return;  // computed by the host (moe.cu, host experts)
    if (e >= split) {
        W = Wf;
        e -= split;
    }
    const bf16_t* base = W + e * 2LL * I * K;
    const float* xs = x + (s / x_div) * x_stride;
    float g = dot_row(base + (long long)n * K, xs, K, lane);
    float u = dot_row(base + (long long)(I + n) * K, xs, K, lane);
    if (lane == 0) h[(long long)s * I + n] = silu_portable(g) * u;
}
