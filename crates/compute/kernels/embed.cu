// Embedding lookups: x[b, i] = table[tok[b], i] as f32, for B rows (grid (ceil(H/256), B), block
// 256; tok[b] < V, checked by the engine before it is written).
//
// embed_bf16: a bf16 table [V, H].
// embed_affine: an affine table: words u32 [V, H·bits/32] (LSB first; bits 2, 4 or 8) and one
//   scale and bias per group of G values [V, H/G] (aff_t, common.cuh: bf16 for MLX; built with
//   AFFINE_F16_ZERO, f16 scales and zero points; with AFFINE_F32, f32 scales and biases), x[b, i] =
//   q·scale + bias with one rounding (fma).

extern "C" __global__ void embed_bf16(const bf16_t* __restrict__ table, const int* __restrict__ tok,
                                      float* __restrict__ x, int H) {
    pdl_entry();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int b = blockIdx.y;
    if (i < H) x[(long long)b * H + i] = bf16f(table[(long long)tok[b] * H + i]);
}

extern "C" __global__ void embed_affine(const unsigned int* __restrict__ words, const aff_t* __restrict__ sc,
                                        const aff_t* __restrict__ bi, const int* __restrict__ tok,
                                        float* __restrict__ x, int H, int G, int bits) {
    pdl_entry();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= H) return;
    int b = blockIdx.y;
    long long row = tok[b];
    x += (long long)b * H;
    int per = 32 / bits;
    unsigned int w = words[row * (H / per) + i / per];
    float q = (float)((w >> ((i % per) * bits)) & ((1u << bits) - 1u));
    long long g = row * (H / G) + i / G;
    const float scale = aff_scale(sc[g]);
    x[i] = fmaf(q, scale, aff_bias(bi[g], scale));
}
