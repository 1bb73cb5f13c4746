// Matrix-vector products on MLX affine-quantized weights (bits 2, 4 or 8), activations f32.
//
// Layout per matrix [N, K]: words u32 [N, K·bits/32], values LSB-first (value i of a word is
// (w >> (i·bits)) & (2^bits − 1)); scales, biases bf16 [N, K/G] for groups of G consecutive
// weights (G a power of two, 32 to 128); w = q·scale + bias. Stacked experts: [E, N, …].
// Built with AFFINE_F16_ZERO: f16 scales and zero points in their place; with AFFINE_F32: f32
// scales and biases (common.cuh, aff_t, aff_scale).
// FMA dequant form per word: acc += scale·Σ q·x + bias·Σ x (one word never spans two groups).
// x must be 16-byte aligned (device buffers are).
//
// matvec_affine{BITS}_r{R}: y[s, n] = Σ_k W_e[n, k] x_s[k] (+ bias_vec[e·N + n]); e = ids ? ids[s] : 0;
//   x_s = x + (s / x_div)·x_stride (x_stride a multiple of 4); slots as in matvec.cu.
//   grid (S, ceil(N/(8·R))), block 256: a warp per R rows, lanes on consecutive words.
//   Far experts: ids ≥ split read matrix ids − split of a second stack (Wf, Sf, Bf) of the same
//   layout, e.g. offloaded experts in pinned host memory; split = INT_MAX when there is none.
//   Slots with ids < 0 are skipped (their output is left as it is: the host computes them).
// Without ids (one matrix), the first blocks of slot 0 ask L2 for their rows before waiting on the
// kernel before (common.cuh, PREFETCH_BLOCKS).
// matvec_swiglu_affine{BITS}_r{R}: h[s, n] = silu(G_e[n]·x_s) · U_e[n]·x_s with W_e [2I, K] (gate rows
//   first). grid (S, ceil(I/(W·R/2))), block 32·W: a warp per R/2 outputs (R rows); W = 4 for the
//   near one-row entries (_r2 without _far), 8 for the others (ops.rs, swiglu_warps_per_block).
//   silu is silu_portable (common.cuh): the host's cpu::gpu_twin computes these outputs bit for
//   bit, so routed experts can run on either side.

// moe_down_combine_affine{BITS}[_r8]: one MoE layer's expert down projections and their
//   weighted sum added to the residual: x[b, n] += Σ_{k<KS} w[b·KS + k] · (D_e[n] · h[b·KS + k])
//   with e = ids[b·KS + k] (far experts as matvec_affine; no host slots; e < 0, another GPU's
//   expert, adds nothing), D_e [N, K]. The same values as matvec_affine{BITS} into y then moe.cu's moe_combine with accumulate: each dot in
//   dot_rows_affine's order (the same for any rows per warp), the terms summed in k order.
//   grid (ceil(N/R), B), block 32·KS: warp k computes the block's R rows for slot k (R = 4, or 8
//   for the 4- and 8-bit _r8 entries), the block meets in shared memory and R threads add the
//   sums. KS ≤ 32 (≤ 28 for _r8, at 72 registers), N ≥ R.
// The routed ids, weights and inputs come from the kernels before: read through plain pointers,
// not `const __restrict__` ones (common.cuh, pdl_entry).

// Words per lane and row in flight before any is used.
#define QMV_UNROLL 4
// Most rows a warp computes together (each input value loaded then serves them all): the host
// picks 4 for large matrices and 1 for small ones, where more warps beat fewer loads.
#define QMV_ROWS 4
// Rows of the fused expert down + combine per block (each warp computes them for its slot), and
// its words per lane and row in flight: an expert down row is short (K = 512 on the 35B shape, 64
// words at 4 bits, two per lane), so QMV_UNROLL's 4 would hold two dead words a row; with 2 the
// kernel takes 51 registers instead of 64 and its 512 blocks fit one wave. Where 4-row blocks fit
// one wave they stay: 8 rows a block would halve the warps in flight and lengthen each warp's
// chain. Where they do not (the 80B shape's 11 slots: 512 blocks of 11 warps against 396
// resident), the _r8 entries take 8 rows a block at 72 registers, 256 blocks in one wave of 2 an
// SM (moe.rs, down_rows): a second wave costs more than the longer chains.
#define DOWN_ROWS 4
#define DOWN_ROWS_WIDE 8
#define DOWN_UNROLL 2

// Code i of word p as an exact f32: 2^23 + q has q in its low mantissa bits, so OR-ing q into
// 0x4B000000 and subtracting 2^23 converts it without the slower integer conversion. The shift,
// mask and OR are a shift and one three-input lop3, (a & b) | c.
template <int BITS>
__device__ __forceinline__ float code_f32(unsigned p, int i) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(p >> (i * BITS)), "r"((1u << BITS) - 1u), "r"(0x4B000000u));
    return __uint_as_float(r) - 8388608.0f;
}

// 4 bits: code i of word p (hi = p >> 12) times 16^c4_shift(i) as an exact f32, with no shift of
// its own: the mask leaves q·16^j in place (j = i for codes 0..4, whose bits lie below bit 23;
// codes 5..7 sit at j = 2..4 of hi), one lop3 ORs in 2^23 and one add takes it off. The input
// that meets it is scaled by 16^−j (exact), so each product, and so each FMA, is the same as
// q·x's: 9 integer instructions a word instead of 15.
__device__ __forceinline__ int c4_shift(int i) { return i < 5 ? i : i - 3; }
__device__ __forceinline__ float code4_scaled(unsigned p, unsigned hi, int i) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(i < 5 ? p : hi), "r"(0xFu << (4 * c4_shift(i))), "r"(0x4B000000u));
    return __uint_as_float(r) - 8388608.0f;
}

// Rows `rows[0..R)` (R ≤ QMV_ROWS valid: `nrows`) of one matrix against x, FMA dequant form.
// Lane l reads words l, l + 32, … of each row (128 contiguous bytes per warp load); the V = 32/BITS
// inputs of a word are loaded once (float4s) and used for every row. Group of word w is
// (w·V) >> gshift. Returns the warp-summed dot products in every lane (REDUCE), or each lane's
// partial sums for the caller to meet.
// GT (a group size of 32, 64 or 128 as a template argument, which then fixes gshift at compile
// time, or 0: gshift's): with it each row's scale and bias pointers start at the lane's first word
// and advance by 32·V/G groups a word (32·V ≥ G, both powers of two, so the same groups), one add
// a load; without it each word's scale and bias addresses come from the row's 64-bit offset,
// about five integer instructions a load.
template <int BITS, int R, bool SB_L1, int UNROLL = QMV_UNROLL, int GT = 0, bool REDUCE = true>
__device__ void dot_rows_affine(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                const aff_t* __restrict__ B, const long long* rows, int nrows,
                                const float* x, int K, int gshift, int lane,
                                float out[R]) {
    const int V = 32 / BITS;
    const int nw = K / V;
    if (GT) gshift = GT == 32 ? 5 : GT == 64 ? 6 : 7;
    const long long gpr = K >> gshift;
    const int gstep = (32 * V) >> gshift;
    const aff_t* ps[R];
    const aff_t* pb[R];
    if (GT) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const long long at = rows[r] * gpr + ((lane * V) >> gshift);
            ps[r] = S + at;
            pb[r] = B + at;
        }
    }
    // SB_L1 (the expert kernels of a one-row decode step): the rows' scales and biases, read
    // once per word after its products (the compiler places those loads there), are asked of L1
    // now, so they do not each wait on memory in the middle of the products; lanes 0..7 take
    // 128-byte parts 0..3 of the scale and bias rows. It pays at one row only: with batches (4
    // rows a warp, many blocks) the extra requests cost more than they hide, and the one-row
    // SwiGLU that steps its scale pointers (GT) does without it.
    if (SB_L1 && lane < 8 && (lane >> 1) * 128 < gpr * (long long)sizeof(aff_t)) {
        const char* base = (lane & 1 ? (const char*)B : (const char*)S) + (lane >> 1) * 128;
#pragma unroll
        for (int r = 0; r < R; ++r)
            if (r < nrows) l1_prefetch(base + rows[r] * gpr * (long long)sizeof(aff_t));
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int base = lane; base < nw; base += 32 * UNROLL) {
        unsigned int p[UNROLL][R];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                int wi = base + 32 * u;
                p[u][r] = (wi < nw && r < nrows) ? __ldcs(W + rows[r] * nw + wi) : 0u;
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            int wi = base + 32 * u;
            if (wi >= nw) break;
            int k = wi * V;
            float xv[V];
            float xs = 0.f;
#pragma unroll
            for (int c = 0; c < V / 4; ++c) {
                float4 f = *reinterpret_cast<const float4*>(x + k + 4 * c);
                xv[4 * c] = f.x;
                xv[4 * c + 1] = f.y;
                xv[4 * c + 2] = f.z;
                xv[4 * c + 3] = f.w;
                xs += (f.x + f.y) + (f.z + f.w);
            }
            if (BITS == 4) {
#pragma unroll
                for (int i = 0; i < V; ++i) xv[i] *= __uint_as_float((127u - 4u * c4_shift(i)) << 23);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r < nrows) {
                    float qx = 0.f;
                    const unsigned hi = p[u][r] >> 12;
#pragma unroll
                    for (int i = 0; i < V; ++i)
                        qx = fmaf(BITS == 4 ? code4_scaled(p[u][r], hi, i) : code_f32<BITS>(p[u][r], i), xv[i], qx);
                    if (GT) {
                        const float sc = aff_scale(ps[r][u * gstep]);
                        acc[r] = fmaf(sc, qx, fmaf(aff_bias(pb[r][u * gstep], sc), xs, acc[r]));
                    } else {
                        const long long gi = rows[r] * gpr + (k >> gshift);
                        const float sc = aff_scale(S[gi]);
                        acc[r] = fmaf(sc, qx, fmaf(aff_bias(B[gi], sc), xs, acc[r]));
                    }
                }
            }
        }
        if (GT) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                ps[r] += UNROLL * gstep;
                pb[r] += UNROLL * gstep;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = REDUCE ? warp_sum(acc[r]) : acc[r];
}

// The warp sums of a lane's two values, spread over the lanes: lanes 0..15 get value 0's,
// 16..31 value 1's, bit for bit warp_sum's (see warp_sum4_scatter) in 5 shuffles instead of 10.
__device__ __forceinline__ float warp_sum2_scatter(const float a[2], int lane) {
    const bool h16 = lane & 16;
    float k = h16 ? a[1] : a[0];
    k += __shfl_xor_sync(0xffffffffu, h16 ? a[0] : a[1], 16);
    for (int o = 8; o > 0; o >>= 1) k += __shfl_xor_sync(0xffffffffu, k, o);
    return k;
}

// The warp sums of a lane's four values, spread over the lanes: lane l gets the sum of value
// l >> 3. The same butterfly as warp_sum (partners l ^ 16, 8, 4, 2, 1, each lane adding its
// partner's term to its own), so each sum is warp_sum's bit for bit, in 6 shuffles instead of 20:
// at the first two steps each lane keeps half of its values and sends the other half.
__device__ __forceinline__ float warp_sum4_scatter(const float a[4], int lane) {
    const bool h16 = lane & 16, h8 = lane & 8;
    float k0 = h16 ? a[2] : a[0], k1 = h16 ? a[3] : a[1];
    const float s0 = h16 ? a[0] : a[2], s1 = h16 ? a[1] : a[3];
    k0 += __shfl_xor_sync(0xffffffffu, s0, 16);
    k1 += __shfl_xor_sync(0xffffffffu, s1, 16);
    float k = h8 ? k1 : k0;
    k += __shfl_xor_sync(0xffffffffu, h8 ? k0 : k1, 8);
    for (int o = 4; o > 0; o >>= 1) k += __shfl_xor_sync(0xffffffffu, k, o);
    return k;
}

// grid (S, ceil(N / (8·R))), block 256: warp w of block (s, b) computes rows (b·8 + w)·R + 0..R
// of slot s.
template <int BITS, int R>
__device__ void matvec_affine_t(const unsigned int* W, const aff_t* S, const aff_t* B, const float* x,
                                float* y, int N, int K, int G, const int* ids, long long x_stride,
                                int x_div, const float* bias, const unsigned int* Wf, const aff_t* Sf,
                                const aff_t* Bf, int split) {
    int row0 = (blockIdx.y * 8 + (threadIdx.x >> 5)) * R;
    int lane = threadIdx.x & 31;
    int s = blockIdx.x;
    if (row0 >= N) return;
    long long e = ids ? ids[s] : 0;
    if (e < 0) return;  // computed by the host (moe.cu, host experts)
    if (e >= split) {
        W = Wf;
        S = Sf;
        B = Bf;
        e -= split;
    }
    int nrows = min(R, N - row0);
    long long rows[R];
#pragma unroll
    for (int r = 0; r < R; ++r) rows[r] = e * N + row0 + r;
    float out[R];
    dot_rows_affine<BITS, R, R == 2>(W, S, B, rows, nrows, x + (s / x_div) * x_stride, K, __ffs(G) - 1, lane, out);
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (lane == r && r < nrows) y[(long long)s * N + row0 + r] = out[r] + (bias ? bias[rows[r]] : 0.f);
}

// grid (ceil(I / (W·R/2)), S), block 32·W: warp w computes outputs n0..n0+R/2 from their gate and
// up rows together.
template <int BITS, int R>
__device__ void swiglu_affine_t(const unsigned int* W, const aff_t* S, const aff_t* B, const float* x,
                                float* h, int I, int K, int G, const int* ids, long long x_stride,
                                int x_div, const unsigned int* Wf, const aff_t* Sf, const aff_t* Bf,
                                int split) {
    const int NPW = R / 2;
    int n0 = (blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5)) * NPW;
    int lane = threadIdx.x & 31;
    int s = blockIdx.x;
    if (n0 >= I) return;
    long long e = ids ? ids[s] : 0;
    if (e < 0) return;  // computed by the host (moe.cu, host experts)
    if (e >= split) {
        W = Wf;
        S = Sf;
        B = Bf;
        e -= split;
    }
    int nn = min(NPW, I - n0);
    long long rows[R];
#pragma unroll
    for (int r = 0; r < NPW; ++r) {
        int n = n0 + (r < nn ? r : 0);
        rows[r] = e * 2LL * I + n;
        rows[NPW + r] = e * 2LL * I + I + n;
    }
    float out[R];
    // Two rows a warp (the one-row SwiGLU) with groups of 64 step their scale and bias pointers
    // (with four rows a warp the extra pointers would spill), and do without SB_L1: with the
    // pointers stepped, asking L1 for the scales ahead costs more than it saves.
    // One output a warp (R = 2): its gate and up sums meet in lane 0 by warp_sum2_scatter.
    constexpr bool REDUCE = R != 2;
    if (R == 2 && G == 64)
        dot_rows_affine<BITS, R, false, QMV_UNROLL, 64, REDUCE>(W, S, B, rows, R, x + (s / x_div) * x_stride, K, __ffs(G) - 1, lane, out);
    else
        dot_rows_affine<BITS, R, R == 2, QMV_UNROLL, 0, REDUCE>(W, S, B, rows, R, x + (s / x_div) * x_stride, K, __ffs(G) - 1, lane, out);
    if (R == 2) {
        const float sum = warp_sum2_scatter(out, lane);
        const float up = __shfl_down_sync(0xffffffffu, sum, 16);
        if (lane == 0) h[(long long)s * I + n0] = silu_portable(sum) * up;
        return;
    }
#pragma unroll
    for (int r = 0; r < NPW; ++r)
        if (lane == r && r < nn) h[(long long)s * I + n0 + r] = silu_portable(out[r]) * out[NPW + r];
}

template <int BITS, int ROWS>
__device__ __forceinline__ void down_combine_t(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                               const aff_t* __restrict__ B, const float* h,
                                               float* __restrict__ x, const float* w,
                                               const int* ids, int N, int K, int G, int KS,
                                               const unsigned int* __restrict__ Wf, const aff_t* __restrict__ Sf,
                                               const aff_t* __restrict__ Bf, int split) {
    __shared__ float part[32][ROWS];
    const int k = threadIdx.x >> 5, lane = threadIdx.x & 31, row = blockIdx.y;
    const int n0 = blockIdx.x * ROWS, nrows = min(ROWS, N - n0);
    const int s = row * KS + k;
    long long e = ids[s];
    if (e >= split) {
        W = Wf;
        S = Sf;
        B = Bf;
        e -= split;
    }
    // The block's rows, or in a last block of fewer the last ROWS rows of the matrix (N ≥
    // ROWS), so that every warp computes ROWS rows: with a row count known at compile
    // time the products have no branch per row, which had kept ptxas from scheduling the rows
    // together.
    const int nb = min(n0, N - ROWS), shift = n0 - nb;
    long long rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = e * N + nb + r;
    // The combine's weights and residual rows are copied into shared memory while the products
    // run (no registers held), rather than loaded after the block meets.
    __shared__ float wk[32], x_old[ROWS];
    if (threadIdx.x < KS) cp_async4(&wk[threadIdx.x], w + row * KS + threadIdx.x);
    if (threadIdx.x < nrows) cp_async4(&x_old[threadIdx.x], x + (long long)row * N + n0 + threadIdx.x);
    cp_async_commit();
    float acc[ROWS];
    // A slot of another GPU's expert (id < 0, expert parallel) adds nothing; the warp still
    // meets the block.
    if (e >= 0) {
        dot_rows_affine<BITS, ROWS, true, DOWN_UNROLL, 0, false>(W, S, B, rows, ROWS, h + (long long)s * K, K, __ffs(G) - 1, lane, acc);
    } else {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    }
    // The warp sums, four rows at a time by warp_sum4_scatter (the same values as four warp_sum,
    // in 6 shuffles instead of 20).
    static_assert(ROWS == 4 || ROWS == 8, "warp_sum4_scatter sums four rows");
#pragma unroll
    for (int q = 0; q < ROWS; q += 4) {
        const float mine = warp_sum4_scatter(acc + q, lane);
        if ((lane & 7) == 0) part[k][q + (lane >> 3)] = mine;
    }
    cp_async_wait_all();
    __syncthreads();
    if (threadIdx.x < nrows) {
        const int r = threadIdx.x;
        float acc = 0.f;
        for (int j = 0; j < KS; ++j) acc = fmaf(wk[j], part[j][r + shift], acc);
        x[(long long)row * N + n0 + r] = x_old[r] + acc;
    }
}

// BOUNDS: the entry's launch bounds or register cap (ptxas takes one of the two).
#define QMV_DOWN_COMBINE(BITS, ROWS, SFX, BOUNDS)                                                                       \
    extern "C" __global__ void BOUNDS moe_down_combine_affine##BITS##SFX(                                               \
        const unsigned int* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,                 \
        const float* h, float* __restrict__ x, const float* w, const int* ids,                                           \
        int N, int K, int G, int KS, const unsigned int* __restrict__ Wf, const aff_t* __restrict__ Sf,                \
        const aff_t* __restrict__ Bf, int split) {                                                                     \
        pdl_entry();                                                                                                    \
        down_combine_t<BITS, ROWS>(W, S, B, h, x, w, ids, N, K, G, KS, Wf, Sf, Bf, split);                             \
    }

QMV_DOWN_COMBINE(2, DOWN_ROWS, , __launch_bounds__(1024))
QMV_DOWN_COMBINE(4, DOWN_ROWS, , __launch_bounds__(1024))
QMV_DOWN_COMBINE(8, DOWN_ROWS, , __launch_bounds__(1024))
// 8 rows under 64 registers spill (76 bytes); at 72, 28 warps a block at most. Not at 2 bits,
// whose 16 inputs a word spill there.
QMV_DOWN_COMBINE(4, DOWN_ROWS_WIDE, _r8, __maxnreg__(72))
QMV_DOWN_COMBINE(8, DOWN_ROWS_WIDE, _r8, __maxnreg__(72))

// The entry points, one per (bits, rows per warp) so that each gets the registers it needs
// (one kernel holding every form would take the largest form's count everywhere): blocks
// resident per SM at least QMV_MIN_BLOCKS_R2 with 2 rows per warp, QMV_MIN_BLOCKS_R4 with 4.
// The expert projections of a 35B decode step (9 experts × 64 blocks) fit one wave of 5 blocks
// per SM at 48 registers, but under that cap the compiler issues a batch's later words only after
// the first word's products, two memory round trips per batch instead of one; at 64 registers
// (4 blocks, 528 of the 576 in the first wave) it issues them together, which saves more than
// the blocks left to a second wave cost. Experts read over PCIe (a far stack) are bound by the
// requests in flight rather than by the round trips: their launches take the `_far` entries, 5
// blocks an SM.
#define QMV_MIN_BLOCKS_R2 4
#define QMV_MIN_BLOCKS_R4 4
#define QMV_MIN_BLOCKS_FAR 5
// The one-row SwiGLU (9 experts × 512 outputs, a warp each on the 35B shape: 4608 warps) fits
// one wave only below 57 registers (36 warps an SM); in blocks of 4 warps, 9 an SM, the cap is
// 56, still high enough for a batch's words to be issued together, and the 576 blocks of 8
// warps that ran in two waves at 64 registers become 1152 of 4 in one (4-warp blocks alone, at 64
// registers and still two waves, do not pay: the single wave does).
#define QMV_SWIGLU_R2_THREADS 128
#define QMV_MIN_BLOCKS_SWIGLU_R2 9

template <int BITS, int R>
__device__ __forceinline__ void matvec_affine_entry(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                                    const aff_t* __restrict__ B, const float* x,
                                                    float* __restrict__ y, int N, int K, int G,
                                                    const int* ids, long long x_stride, int x_div,
                                                    const float* __restrict__ bias, const unsigned int* __restrict__ Wf,
                                                    const aff_t* __restrict__ Sf, const aff_t* __restrict__ Bf,
                                                    int split) {
    if (!ids && blockIdx.x == 0) {
        long long r0 = (long long)blockIdx.y * 8 * R, rb = (long long)K * BITS / 8, sb = K / G * (long long)sizeof(aff_t);
        l2_prefetch_rows(W, r0, 8 * R, N, rb, blockIdx.y);
        l2_prefetch_rows(S, r0, 8 * R, N, sb, blockIdx.y);
        l2_prefetch_rows(B, r0, 8 * R, N, sb, blockIdx.y);
    }
    pdl_entry();
    matvec_affine_t<BITS, R>(W, S, B, x, y, N, K, G, ids, x_stride, x_div, bias, Wf, Sf, Bf, split);
}

template <int BITS, int R>
__device__ __forceinline__ void swiglu_affine_entry(const unsigned int* __restrict__ W, const aff_t* __restrict__ S,
                                                    const aff_t* __restrict__ B, const float* x,
                                                    float* __restrict__ h, int I, int K, int G,
                                                    const int* ids, long long x_stride, int x_div,
                                                    const unsigned int* __restrict__ Wf,
                                                    const aff_t* __restrict__ Sf, const aff_t* __restrict__ Bf,
                                                    int split) {
    if (!ids && blockIdx.x == 0) {
        long long n0 = (long long)blockIdx.y * 4 * R, rb = (long long)K * BITS / 8, sb = K / G * (long long)sizeof(aff_t);
        for (int half = 0; half < 2; ++half) {
            long long r0 = half * (long long)I;
            l2_prefetch_rows(W, r0 + n0, 4 * R, r0 + I, rb, blockIdx.y);
            l2_prefetch_rows(S, r0 + n0, 4 * R, r0 + I, sb, blockIdx.y);
            l2_prefetch_rows(B, r0 + n0, 4 * R, r0 + I, sb, blockIdx.y);
        }
    }
    pdl_entry();
    swiglu_affine_t<BITS, R>(W, S, B, x, h, I, K, G, ids, x_stride, x_div, Wf, Sf, Bf, split);
}

#define QMV_ENTRIES(BITS, R, MINB, SFX) QMV_ENTRIES_SW(BITS, R, MINB, SFX, 256, MINB)
// SWT, SWMINB: the SwiGLU entry's block size and resident blocks (launch bounds).
#define QMV_ENTRIES_SW(BITS, R, MINB, SFX, SWT, SWMINB)                                                       \
    extern "C" __global__ void __launch_bounds__(256, MINB) matvec_affine##BITS##_r##R##SFX(                  \
        const unsigned int* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,       \
        const float* x, float* __restrict__ y, int N, int K, int G, const int* ids,                           \
        long long x_stride, int x_div, const float* __restrict__ bias, const unsigned int* __restrict__ Wf,   \
        const aff_t* __restrict__ Sf, const aff_t* __restrict__ Bf, int split) {                            \
        matvec_affine_entry<BITS, R>(W, S, B, x, y, N, K, G, ids, x_stride, x_div, bias, Wf, Sf, Bf, split);  \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(SWT, SWMINB) matvec_swiglu_affine##BITS##_r##R##SFX(         \
        const unsigned int* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B,       \
        const float* x, float* __restrict__ h, int I, int K, int G, const int* ids,                           \
        long long x_stride, int x_div, const unsigned int* __restrict__ Wf, const aff_t* __restrict__ Sf,    \
        const aff_t* __restrict__ Bf, int split) {                                                           \
        swiglu_affine_entry<BITS, R>(W, S, B, x, h, I, K, G, ids, x_stride, x_div, Wf, Sf, Bf, split);        \
    }

QMV_ENTRIES_SW(2, 2, QMV_MIN_BLOCKS_R2, , QMV_SWIGLU_R2_THREADS, QMV_MIN_BLOCKS_SWIGLU_R2)
QMV_ENTRIES_SW(4, 2, QMV_MIN_BLOCKS_R2, , QMV_SWIGLU_R2_THREADS, QMV_MIN_BLOCKS_SWIGLU_R2)
QMV_ENTRIES_SW(8, 2, QMV_MIN_BLOCKS_R2, , QMV_SWIGLU_R2_THREADS, QMV_MIN_BLOCKS_SWIGLU_R2)
QMV_ENTRIES(2, 4, QMV_MIN_BLOCKS_R4, )
QMV_ENTRIES(4, 4, QMV_MIN_BLOCKS_R4, )
QMV_ENTRIES(8, 4, QMV_MIN_BLOCKS_R4, )
QMV_ENTRIES(2, 2, QMV_MIN_BLOCKS_FAR, _far)
QMV_ENTRIES(4, 2, QMV_MIN_BLOCKS_FAR, _far)
QMV_ENTRIES(8, 2, QMV_MIN_BLOCKS_FAR, _far)
