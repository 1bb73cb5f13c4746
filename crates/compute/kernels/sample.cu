// Token embedding and greedy sampling for decode; the token id and the position live in device
// memory so a captured graph replays them.
//
// embed_bf16: x[i] = table[tok[0], i]. table: [V, H] bf16. grid ceil(H/256), block 256.
// embed_affine: x[i] = q[tok, i]·scale + bias for an MLX affine table (words u32 [V, H·bits/32],
//   scales and biases bf16 [V, H/G]; bits 2, 4 or 8). grid ceil(H/256), block 256.
// argmax_advance: tok[0] = argmax(logits[0..V]) (lowest index on ties); pos[0] += 1. grid 1, block 1024.

extern "C" __global__ void embed_bf16(const bf16_t* __restrict__ table, const int* __restrict__ tok,
                                      float* __restrict__ x, int H) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < H) x[i] = bf16f(table[(long long)tok[0] * H + i]);
}

extern "C" __global__ void embed_affine(const unsigned int* __restrict__ words, const bf16_t* __restrict__ sc,
                                        const bf16_t* __restrict__ bi, const int* __restrict__ tok,
                                        float* __restrict__ x, int H, int G, int bits) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= H) return;
    long long row = tok[0];
    int per = 32 / bits;
    unsigned int w = words[row * (H / per) + i / per];
    float q = (float)((w >> ((i % per) * bits)) & ((1u << bits) - 1u));
    long long g = row * (H / G) + i / G;
    x[i] = fmaf(q, bf16f(sc[g]), bf16f(bi[g]));
}

extern "C" __global__ void argmax_advance(const float* __restrict__ logits, int V, int* __restrict__ tok,
                                          int* __restrict__ pos) {
    __shared__ float bv_s[32];
    __shared__ int bi_s[32];
    int t = threadIdx.x;
    float bv = NEG_INF;
    int bi = V;
    for (int i = t; i < V; i += blockDim.x) {
        float v = logits[i];
        if (v > bv) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if ((t & 31) == 0) { bv_s[t >> 5] = bv; bi_s[t >> 5] = bi; }
    __syncthreads();
    if (t == 0) {
        int nw = (blockDim.x + 31) >> 5;
        for (int i = 1; i < nw; ++i)
            if (bv_s[i] > bv_s[0] || (bv_s[i] == bv_s[0] && bi_s[i] < bi_s[0])) {
                bv_s[0] = bv_s[i];
                bi_s[0] = bi_s[i];
            }
        tok[0] = bi_s[0];
        pos[0] += 1;
    }
}
