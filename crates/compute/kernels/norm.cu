// RMSNorm with the residual add fused in front.
//
// add_rmsnorm: per row r of width H: if delta, x[r] += delta[r]; out[r] = x[r] / sqrt(mean(x[r]²) + eps) · scale
//   (scale is 1 + w for the zero-centred norms, prepared on upload).
//   x, delta, out: [R, H] f32; scale: [H]. grid R, block 1024 (moe_combine_norm sums in the
//   same order, for equal values).
extern "C" __global__ void add_rmsnorm(float* __restrict__ x, const float* delta,
                                       const float* __restrict__ scale, float* __restrict__ out,
                                       int H, float eps) {
    for (int i = threadIdx.x; i < H; i += blockDim.x) l1_prefetch(scale + i);
    pdl_entry();
    float* xr = x + (long long)blockIdx.x * H;
    const float* dr = delta ? delta + (long long)blockIdx.x * H : nullptr;
    float* orow = out + (long long)blockIdx.x * H;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float v = xr[i];
        if (dr) { v += dr[i]; xr[i] = v; }
        ss += v * v;
    }
    float r = rsqrtf(block_sum(ss) / H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) orow[i] = xr[i] * r * scale[i];
}
