// Random fills for synthetic (benchmark) weights made directly in device memory.
//
// fill_uniform_bf16 / _f16 / _f32: out[i] = lo + (hi − lo) · u(seed, i), u ∈ [0, 1) from
//   splitmix64 of (seed, i); fill_random_u32: random 32-bit words (packed quantized weights);
//   fill_random_fp8: the same words with bit 3 of each byte cleared, so that every byte is an e4m3
//   code of even exponent ≤ 14 (|value| ≤ 240, never NaN).
//   grid-stride loops, any grid, block 256.

__device__ __forceinline__ float uniform01(unsigned long long seed, long long i) {
    unsigned long long z = seed + (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

extern "C" __global__ void fill_uniform_bf16(bf16_t* __restrict__ out, long long n, unsigned long long seed,
                                             float lo, float hi) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = lo + (hi - lo) * uniform01(seed, i);
        unsigned int b = __float_as_uint(v);
        b += 0x7fffu + ((b >> 16) & 1u);
        out[i] = (bf16_t)(b >> 16);
    }
}

extern "C" __global__ void fill_uniform_f16(unsigned short* __restrict__ out, long long n, unsigned long long seed,
                                            float lo, float hi) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(lo + (hi - lo) * uniform01(seed, i)));
        out[i] = h;
    }
}

__device__ __forceinline__ unsigned random_word(unsigned long long seed, long long i) {
    return (unsigned int)(uniform01(seed, 2 * i) * 65536.f) | ((unsigned int)(uniform01(seed, 2 * i + 1) * 65536.f) << 16);
}

extern "C" __global__ void fill_random_u32(unsigned int* __restrict__ out, long long n, unsigned long long seed) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = random_word(seed, i);
}

extern "C" __global__ void fill_random_fp8(unsigned int* __restrict__ out, long long n, unsigned long long seed) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = random_word(seed, i) & 0xf7f7f7f7u;
}

extern "C" __global__ void fill_uniform_f32(float* __restrict__ out, long long n, unsigned long long seed,
                                            float lo, float hi) {
    pdl_entry();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = lo + (hi - lo) * uniform01(seed, i);
}
