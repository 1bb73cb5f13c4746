// Shared device helpers, prepended to every kernel file by the kernel registry.
// bf16 values travel as raw 16-bit patterns (no toolkit headers needed under NVRTC).
typedef unsigned short bf16_t;
#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float bf16f(bf16_t v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ float bf16lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

// An affine group's scale and bias as f32, from the values its scale and bias arrays hold
// (`aff_t` each): every read of affine weights' parameters goes through these two. The kernel
// registry builds the files that read them three times (cuda/kernels.rs): as they are, for MLX's
// bf16 scales and biases (w = q·scale + bias); with AFFINE_F16_ZERO, for GPTQ/AWQ's f16 scales s
// and f16 integer zero points z in the biases' place (w = (q − z)·s), taken as scale s and bias
// −z·s: exact in f32 (z ≤ 255, s has 11 significant bits), so the kernels' dequant forms give what
// they give for f32 parameters s and −z·s; and with AFFINE_F32, for f32 scales and biases (GGUF's
// K-quants, whose d·sc and dmin·m have up to 17 significant bits), 4 bytes each. Code that moves
// parameters by bytes takes sizeof(aff_t).
#if defined(AFFINE_F32)
typedef unsigned aff_t;
__device__ __forceinline__ float aff_scale(aff_t s) { return __uint_as_float(s); }
__device__ __forceinline__ float aff_bias(aff_t b, float) { return __uint_as_float(b); }
#elif defined(AFFINE_F16_ZERO)
typedef unsigned short aff_t;
__device__ __forceinline__ float f16f(unsigned short v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ float aff_scale(aff_t s) { return f16f(s); }
__device__ __forceinline__ float aff_bias(aff_t z, float scale) { return -f16f(z) * scale; }
#else
typedef unsigned short aff_t;
__device__ __forceinline__ float aff_scale(aff_t s) { return bf16f(s); }
__device__ __forceinline__ float aff_bias(aff_t b, float) { return bf16f(b); }
#endif

// The tensor-core forms' entries for 8-bit codes in groups of 16 (suffix _g16; mma_rows.cu,
// mma_wide.cu, mma_vec.cu) exist in the f32-parameter build only (their one source, GGUF's
// K-quants, has f32 parameters), beside the others so that those keep their code and registers;
// the other builds compile no code for them.
#if defined(AFFINE_F32)
#define AFFINE_G16 1
#else
#define AFFINE_G16 0
#endif

// The e4m3 (FP8) byte b as f32, exact: its magnitude bits placed at the top of an f32 (exponent
// field = e4m3 exponent, subnormals included) times 2^(127 − 7); 0x7f / 0xff are NaN.
__device__ __forceinline__ float e4m3f(unsigned b) {
    const float v = __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 0x1p120f;
    return (b & 0x7fu) == 0x7fu ? __int_as_float(0x7fffffff) : v;
}

// The 4 e4m3 codes of w (lowest byte first) as f32, exact. On sm_89 and later the hardware
// converts two codes to an f16 pair in one instruction (e4m3 values are f16 values; 0x7f / 0xff
// give NaN as e4m3f does) and an f16 widens to f32 on the FMA pipe.
__device__ __forceinline__ void e4m3x4(unsigned w, float f[4]) {
#if __CUDA_ARCH__ >= 890
    asm("{\n\t.reg .b16 c0, c1, h0, h1, h2, h3;\n\t.reg .b32 p0, p1;\n\t"
        "mov.b32 {c0, c1}, %4;\n\t"
        "cvt.rn.f16x2.e4m3x2 p0, c0;\n\t"
        "cvt.rn.f16x2.e4m3x2 p1, c1;\n\t"
        "mov.b32 {h0, h1}, p0;\n\t"
        "mov.b32 {h2, h3}, p1;\n\t"
        "cvt.f32.f16 %0, h0;\n\tcvt.f32.f16 %1, h1;\n\tcvt.f32.f16 %2, h2;\n\tcvt.f32.f16 %3, h3;\n\t}"
        : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3])
        : "r"(w));
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = e4m3f((w >> (8 * i)) & 0xffu);
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float s[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) s[w] = v;
    __syncthreads();
    v = (threadIdx.x < nw) ? s[threadIdx.x] : 0.f;
    if (w == 0) v = warp_sum(v);
    if (threadIdx.x == 0) s[0] = v;
    __syncthreads();
    float r = s[0];
    __syncthreads();
    return r;
}

// The block's largest v and its i (the lowest i on ties), as block_sum: every thread gets them.
__device__ void block_argmax(float& v, int& i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        sv[w] = v;
        si[w] = i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < nw; ++k)
            if (sv[k] > v || (sv[k] == v && si[k] < i)) {
                v = sv[k];
                i = si[k];
            }
        sv[0] = v;
        si[0] = i;
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads();
}

// Max over the block, as block_sum.
__device__ float block_max(float v) {
    __shared__ float s[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) s[w] = v;
    __syncthreads();
    v = (threadIdx.x < nw) ? s[threadIdx.x] : NEG_INF;
    if (w == 0) v = warp_max(v);
    if (threadIdx.x == 0) s[0] = v;
    __syncthreads();
    float r = s[0];
    __syncthreads();
    return r;
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// silu(x) = x / (1 + e^−x) from IEEE-exact operations only (explicit fmaf, mul, div, rintf, bit
// patterns), so the host twin `cpu::gpu_twin::silu_portable` computes the same bits; expf is a
// hardware approximation no host can reproduce. Used where the host computes some routed experts
// of a decode step and logits must not depend on which side did (matvec_swiglu_bf16,
// matvec_swiglu_affine). No product feeds an add except inside an explicit fmaf, so contraction
// cannot change it. Error ≤ 3 ulp where |silu(x)| ≥ 1e-36.
//   x NaN: x. e^−x ≥ 2^128 (x ≤ −89, or overflow in the last fmaf): −0. e^−x < 2^−150 (x > 104): x.
//   Else a = −x, n = rint(a·log2 e), r = a − n·ln2 (two fmaf, ln2 = LN2_HI + LN2_LO),
//   e^r by Horner on the degree-7 Taylor polynomial (|r| ≤ 0.35: truncation < 0.05 ulp),
//   1 + e^r·2^n as one fmaf with 2^n = 2^(n>>1) · 2^(n − (n>>1)) (each a normal power of two).
__device__ __forceinline__ float silu_portable(float x) {
    if (x != x) return x;
    float a = -x;
    if (a >= 89.f) return -0.f;
    if (a < -104.f) return x;
    float n = rintf(a * __uint_as_float(0x3fb8aa3bu));        // log2 e
    float r = fmaf(-n, __uint_as_float(0x3f317218u), a);      // ln2, high part
    r = fmaf(-n, __uint_as_float(0xb102e308u), r);            // ln2, low part
    float p = __uint_as_float(0x39500d01u);                   // 1/7!
    p = fmaf(p, r, __uint_as_float(0x3ab60b61u));             // 1/6!
    p = fmaf(p, r, __uint_as_float(0x3c088889u));             // 1/5!
    p = fmaf(p, r, __uint_as_float(0x3d2aaaabu));             // 1/4!
    p = fmaf(p, r, __uint_as_float(0x3e2aaaabu));             // 1/3!
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.f);
    p = fmaf(p, r, 1.f);
    int k = (int)n, k1 = k >> 1;
    float s1 = __int_as_float((k1 + 127) << 23), s2 = __int_as_float((k - k1 + 127) << 23);
    return x / fmaf(p * s1, s2, 1.f);
}

// c += a · b for one m16n8k16 tensor-core tile, bf16 inputs, f32 accumulators (sm_80+): a is
// the row fragment's four registers, b the column fragment's two.
__device__ __forceinline__ void mma_bf16(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// mma_bf16 with the row fragment as an array.
__device__ __forceinline__ void mma_bf16(float c[4], const unsigned* a, unsigned b0, unsigned b1) {
    mma_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}

// {lo, hi} packed as bf16x2, round to nearest even (lo in the low half).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Programmatic dependent launch (sm_90+; no-ops before, and without the launch attribute):
// every kernel first lets the next kernel in the stream start launching, then waits until the
// kernel before it has completed and its writes are visible. The next kernel's blocks thus take
// whatever room this one leaves and do their own work before their wait (weights asked of L2 or
// loaded into registers) while this one and the one before still run. What a kernel reads
// before its wait must not come from any kernel of the same step: with every kernel triggering
// at entry, several kernels ahead may be in that phase at once. Called in every kernel after
// those loads (`pdl_entry`).
// Inputs that an earlier kernel of the step wrote must not be `const __restrict__`: such
// pointers load through the read-only path (ld.global.nc), whose data ptxas takes as constant for
// the whole kernel and may load before griddepcontrol.wait, i.e. before the writer finished (it
// did so with the expert down kernel's ids). Read-only parameters are for weights and what the
// host writes between steps: a unit test holds their names (cuda/kernels.rs,
// read_only_kernel_parameters_are_weights_or_host_tables), and `scripts/pdl-audit.sh` lists
// each kernel's loads ahead of its wait.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// ldmatrix of four 8×8 bf16 tiles (lanes 8i..8i+7 address tile i's rows), plain and transposed.
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

// f32 → bf16, round to nearest even.
__device__ __forceinline__ bf16_t f32_to_bf16_rn(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
    return r;
}

// 4-bit codes q0, q1 < 16 as exact bf16x2: (q | 0x4300) is 128 + q, then subtract 128.
__device__ __forceinline__ unsigned codes4_bf16(unsigned q0, unsigned q1) {
    unsigned p = (q0 | 0x4300u) | ((q1 | 0x4300u) << 16), r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(p), "r"(0x3F803F80u), "r"(0xC300C300u));
    return r;
}

// mbarriers (sm_90 on; before, these are empty and no kernel that needs them is launched).
// An mbarrier expecting one arrival, set up so that the cluster's CTAs may complete bytes on it
// (bulk copies, asynchronous stores from other CTAs).
__device__ __forceinline__ void mbar_init(unsigned long long* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// The one arrival, with the bytes that copies or stores will bring.
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
#endif
}

// Wait until the barrier's phase `parity` completed (all its bytes arrived).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
}

// Clusters (sm_90 on). Every thread of the cluster's blocks arrives (relaxed: no ordering of
// its memory accesses) and later waits on that phase, after which all the blocks have started.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
// The wait's acquire invalidates L1: ask L1 for nothing ahead of it that is needed after it.
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}

// The address of `p` (in this block's shared memory) in the shared memory of the cluster's block
// `rank`.
__device__ __forceinline__ unsigned cluster_map(const void* p, int rank) {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
#endif
    return r;
}

// An asynchronous store into the cluster's block `rank`: v lands at `dst` of its shared memory
// and completes its 4 bytes on its mbarrier `bar` (both addresses as in this block).
__device__ __forceinline__ void st_async_f1(float* dst, float v, unsigned long long* bar, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(cluster_map(dst, rank)), "r"(__float_as_uint(v)), "r"(cluster_map(bar, rank)) : "memory");
#endif
}

// 16-byte asynchronous copy global → shared (sm_80 on); zero fill when !valid (src is then not
// read). Copies complete in commit groups: wait_group<N> waits until at most N of the thread's
// latest groups are still in flight.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}
// 4-byte asynchronous copy global → shared (both ends 4-byte aligned), in the same groups: a
// value needed only at a kernel's end, fetched without holding a register until then.
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Ask L1 for the line holding *p (a hint): a load of it that comes later then waits less.
__device__ __forceinline__ void l1_prefetch(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Ask L1 for the lines of [p, p + bytes): thread i of n takes lines i, i + n, …
__device__ __forceinline__ void l1_prefetch_range(const void* p, long long bytes, int i, int n) {
    const char* c = reinterpret_cast<const char*>(p);
    long long first = (reinterpret_cast<unsigned long long>(c) & 127ull);
    for (long long off = (long long)i * 128 - first; off < bytes; off += (long long)n * 128)
        l1_prefetch(c + (off < 0 ? 0 : off));
}

// Bytes one bulk L2 prefetch instruction asks for.
#define L2_PIECE 16384

// Ask L2 to fetch [p, p + bytes) ahead of its use (sm_90+, a hint; no-op before): thread i of
// the calling threads (`n` of them, i < n) issues bulk prefetches of pieces i, i + n, … The range
// is widened to 16-byte alignment at its start and narrowed at its end, so it stays inside the
// allocation that holds it. Kernels call it on their weights before `pdl_entry`: weights never
// depend on earlier kernels, so they stream into L2 while the kernel before still runs. Each block
// asks only for its own share: one SM's bulk prefetches are served slowly (a whole layer's routed
// experts asked by one warp arrive after the layer has run).
__device__ __forceinline__ void l2_prefetch(const void* p, long long bytes, int i, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (bytes <= 0) return;
    unsigned long long a = (unsigned long long)__cvta_generic_to_global(p);
    unsigned long long start = a & ~15ull, end = (a + (unsigned long long)bytes) & ~15ull;
    for (unsigned long long c = start + (unsigned long long)i * L2_PIECE; c < end;
         c += (unsigned long long)n * L2_PIECE) {
        unsigned len = (unsigned)min((unsigned long long)L2_PIECE, end - c);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c), "r"(len) : "memory");
    }
#endif
}

// l2_prefetch by every thread of the block.
__device__ __forceinline__ void l2_prefetch_block(const void* p, long long bytes) {
    l2_prefetch(p, bytes, threadIdx.x, blockDim.x);
}

// Blocks that ask L2 for their own weights before waiting: about those resident while the kernel
// before runs (two per SM of a 132-SM part); later blocks start after it ended, and their loads
// follow at once.
#define PREFETCH_BLOCKS 264

// l2_prefetch_block of rows row0 .. row0 + rows (clamped to n_rows) of `row_bytes` each, by the
// first PREFETCH_BLOCKS blocks (`block`: the block's index along the rows).
__device__ __forceinline__ void l2_prefetch_rows(const void* base, long long row0, long long rows,
                                                 long long n_rows, long long row_bytes, int block) {
    if (block >= PREFETCH_BLOCKS) return;
    rows = min(rows, n_rows - row0);
    l2_prefetch_block(reinterpret_cast<const char*>(base) + row0 * row_bytes, rows * row_bytes);
}

// Largest GDN conv kernel the decode conv step takes.
#define CONV_KMAX 8

// One channel c of the GDN decode conv (gdn.cu's gdn_conv_step, mma_vec.cu's conv epilogue): its
// K taps w[c, 0..K) and its state column st[j·C + c] (j < K − 1, oldest first) into registers.
__device__ __forceinline__ void conv_load(const float* __restrict__ w, const float* st, int c, int C, int K,
                                          float wv[CONV_KMAX], float sv[CONV_KMAX]) {
    const float* wc = w + (long long)c * K;
#pragma unroll
    for (int j = 0; j < CONV_KMAX; ++j) {
        if (j < K) wv[j] = wc[j];
        if (j < K - 1) sv[j] = st[(long long)j * C + c];
    }
}

// The step with this token's input x: the state column shifts by one and takes x; returns
// silu(Σ_{j<K−1} w_j·st_j + w_{K−1}·x).
__device__ __forceinline__ float conv_advance(const float wv[CONV_KMAX], const float sv[CONV_KMAX], float* st, int c,
                                              int C, int K, float x) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < CONV_KMAX; ++j)
        if (j == K - 1) acc = wv[j] * x;
#pragma unroll
    for (int j = 0; j < CONV_KMAX; ++j)
        if (j < K - 1) acc = fmaf(wv[j], sv[j], acc);
#pragma unroll
    for (int j = 0; j + 1 < CONV_KMAX; ++j)
        if (j + 1 < K - 1) st[(long long)j * C + c] = sv[j + 1];
    if (K > 1) st[(long long)(K - 2) * C + c] = x;
    return silu_f(acc);
}
