// One input row through a 4- or 8-bit MLX affine matrix on tensor cores (decode projections,
// routers, lm_head): y[n] = Σ_k W[n, k] x[k] (+ bias[n]), at about f32 accuracy. Dequantizing on
// CUDA cores costs several instructions per weight, more than the issue rate allows at memory
// speed; here two codes cost a shift and a lop3, and the products run as mma.sync.
//
// 8-bit codes (the _affine8 entries) are read as two 4-bit digits each, q = lo + 16·hi: a row
// of K inputs is a 4-bit row of 2K digits (the same words) whose input is x' = (x_0, 16·x_0,
// x_1, 16·x_1, …), an exact scaling of x_hi and x_lo, and a group of G inputs a group of 2G
// digits. So the products, the offset and the group's scale are those below, and only the bias
// term takes Σ x over the group's inputs rather than Σ x'. The host passes K and G in digits.
//
// Numerics: the weights enter exactly as 128 + q (bf16, the code under a fixed exponent), x is
// split into x_hi = bf16(x) and x_lo = bf16(x − x_hi) (columns 0 and 1 of one product, ~16
// significant bits), and per group of G the FMA dequant form is applied with the offset taken off:
// Σ_k w x = scale·(Σ_k (128 + q) x' − 128·Σ_k x') + bias·Σ_k x, x' = x_hi + x_lo (the group's
// sum of x' in f32, as the products see it).
//
// Layouts: words u32 [N, K/8] (LSB first), scales and biases aff_t [N, K/G] (bf16; built with
// AFFINE_F16_ZERO: f16 scales and zero points; with AFFINE_F32: f32 scales and biases, see
// common.cuh's aff_scale), G ∈ {32, 64, 128} (and 16 for 8-bit codes with f32 parameters), K % G == 0; x f32 [K] (16-byte aligned); y f32 [N];
// bias f32 [N] or null.
//
// The first blocks ask L2 for their rows of W, S and B before waiting on the kernel before it
// (common.cuh, PREFETCH_BLOCKS), every warp loads the words of its first groups before that wait
// too (weights never depend on an earlier kernel), and every block asks L1 for its rows' scales
// and biases, read once per group after the products.
//
// grid ceil(N / (16·T)), block 32·NW (NW = 8 warps, 16 for _staged16), dynamic shared memory
// K·4 + (K/G)·8 bytes; T = `tiles`
// (1 to 4) row tiles of 16 per block. The block stages x once for its 16·T rows: per word
// position w (k = 8w..8w+7) the bf16x2 pairs (x0,x4), (x1,x5), (x2,x6), (x3,x7) of x_hi then of
// x_lo, and the sums of x and of x_hi + x_lo over each group. Warp v takes
// the groups g ≡ v (mod NW), U = clamp(12/(T·P), 1, 4) at a time with all their loads in flight
// when streaming (2·T·P words per group and lane, at most 24; two blocks per SM: launch bounds
// cap the registers at 128), one at a time from a staged tile (see mma_vec_t). Within a group,
// lane (gid, t) of the mma holds rows gid and gid + 8 of each tile (staged one wave: rows 2T·gid
// + 2i and 2T·gid + 2i + 1 of the block's, see vec_run_words) and the group's words
// t·P .. t·P + P (P = G/32, one 4-, 8- or 16-byte load per row): word j of every lane forms one
// 32-wide k chunk, two k16 steps whose k slots {2t, 2t+1} and
// {2t+8, 2t+9} take nibbles (i, i+4) and (i+1, i+5) of the lane's word, and x the same pairs (any
// consistent mapping of k gives the same sum). Input columns 0 and 1 are x_hi and x_lo (B is
// zero in lanes with gid ≥ 2), so one mma per k16 step takes both: half the products of two
// mmas with column 0 alone, which bound the kernel when its weights are already on chip. After
// each group, lanes t = 0 (which hold columns 0 and 1) fold the group's two partial sums in
// with its scale and bias; the warps' sums meet in shared memory.
//
// Several rows (the _rows entries): io.rows = R ≤ 4 input rows io.x_stride floats apart through
// the one matrix, y [R, N]. Row r's x_hi and x_lo are columns 2r and 2r + 1 of B (lanes gid = 2r,
// 2r + 1 load them), so the products cost what one row's do and the weights are read once; lane t
// of the mma, which holds columns 2t and 2t + 1 of D, folds row t's groups. A column of an mma
// accumulates on its own, so each row's arithmetic is the one-row kernel's, bit for bit, when the
// block has as many warps (the order the warps' sums meet in). The norm, normed and accumulate of
// VecIo apply per row (normed [R, K]); conv and best take one row.
//
// VecIo (one per launch, by value) adds to either entry, for a decode layer's fused steps:
// - norm: x is a raw residual row to be taken through an RMSNorm first: the block stages
//   x·norm and takes Σ x² on the way, and scales its outputs by r = 1/sqrt(mean(x²) + eps)
//   (W (x·r·norm) = r·W (x·norm), so the sum is met only after the products); block 0 then
//   writes x·r·norm to `normed` when given. The norms before a layer's mixer and its ffn.
// - accumulate: y[n] += W x (+ bias) instead of y[n] = …: the residual add after a projection.
// - best (the ring kernel only): block b writes best[2b] = the largest of its outputs and
//   best[2b + 1] = its row (the lowest on ties; i32 bits), so a greedy pick after the lm_head
//   reads a pair a block instead of every output.
// - conv (conv_c > 0): rows n < conv_c are also the GDN conv1d inputs of channel n, by gdn.cu's
//   gdn_conv_step's code (common.cuh's conv_load/conv_advance): mixed[n] = silu(Σ_j conv_w[n, j]
//   ·st[j, n] + conv_w[n, Kc−1]·y[n]) with st = conv_state + slots[0]·(Kc−1)·conv_c, which then
//   shifts by one and takes y[n]. Each row belongs to one block, so the state update has one writer.
//
// mma_vec_affine{4,8}_staged, for a launch of one wave: each block instead copies its rows of W, S
// and B into shared memory (after the staged x, rounded to 16 bytes: the tile in 8 runs of rows,
// vec_run_words, then an 8-byte barrier) with bulk copies issued before its wait, and the same
// loop reads the words from there. Bulk copies move whole 16-byte units: a row's scales (K/G of
// sizeof(aff_t) bytes each) must be a multiple of 16 bytes (K/G % 8 == 0 for 2-byte parameters,
// K/G % 4 == 0 for f32 ones; the host checks).
//
// mma_vec_affine{4,8}_ring, for a launch of more tiles than resident blocks (the lm_head): a grid of
// at most the resident blocks, each staging x once and working through the tiles blockIdx.x,
// blockIdx.x + gridDim.x, … (VEC_RING_TILES row tiles each) from `nbuf` staged tiles, each whole
// (16·T rows of K/2 bytes, then their scales and biases: see vec_run_words), one after another,
// then their nbuf barriers. The block's first nbuf tiles are copied
// before its wait; a buffer is refilled with the tile nbuf steps on once every warp is past it,
// so later tiles arrive under the products of earlier ones. The tiles' partial sums alternate
// between two sets in shared memory and every warp adds up 2·T rows of them, so a tile takes one
// block barrier. More tiles in flight (smaller tiles in more buffers, one 16-warp block an SM, L2
// requests for the tiles after the ring's) do not shorten it (docs/experiments.md).

struct VecIo {
    const float* norm;
    float* normed;
    float eps;
    int accumulate;
    const int* slots;
    float* conv_state;
    const float* conv_w;
    float* mixed;
    int conv_c, conv_k;
    float* best;
    int rows, x_stride;
};

// Nibbles i and i + 4 of w as exact bf16x2 (128 + q_i, 128 + q_{i+4}): (q | 0x4300) is 128 + q
// in bf16. A shift and one three-input lop3, (a & b) | c; the offset of 128 leaves the products
// and is taken off each group's sum (128 · Σ x over the group, as the products see x).
__device__ __forceinline__ unsigned nib_pair(unsigned w, int i) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w >> (4 * i)), "r"(0x000F000Fu), "r"(0x43004300u));
    return r;
}

// Bytes of the staged input of R rows (x_hi/x_lo pairs, group sums) rounded to 16: the staged
// weight tile follows it.
__device__ __forceinline__ int vec_stage_bytes(int K, int ng, int R) {
    return (R * (K * 4 + ng * 8) + 15) & ~15;
}

// The bulk copies and their barrier exist from sm_90 on; before, these helpers are empty and the
// host never launches the staged entry (cuda/vec.rs).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define VEC_BULK 1
#else
#define VEC_BULK 0
#endif

// Copy `bytes` (a multiple of 16; both ends 16-byte aligned) from global to shared memory,
// completing on `bar`.
__device__ __forceinline__ void bulk_to_smem(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
#if VEC_BULK
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(__cvta_generic_to_global(src)), "r"(bytes), "r"(smem_u32(bar)) : "memory");
#endif
}

// Order this thread's earlier generic accesses to shared memory before later bulk copies into it
// (the async proxy), for a buffer that is read and then refilled.
__device__ __forceinline__ void fence_proxy_async() {
#if VEC_BULK
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

// P consecutive words of a row at word offset `at` (16-byte aligned for P = 4, 8-byte for 2):
// streamed from global memory, or (SM) read from the block's staged tile in shared memory.
template <bool SM, typename V>
__device__ __forceinline__ V load_word(const V* p) {
    return SM ? *p : __ldcs(p);
}

template <int P, bool SM>
__device__ __forceinline__ void load_words(const unsigned* __restrict__ row, long long at, unsigned out[P]) {
    if (P == 4) {
        uint4 v = load_word<SM>(reinterpret_cast<const uint4*>(row + at));
        out[0] = v.x; out[1] = v.y; out[2 % P] = v.z; out[3 % P] = v.w;
    } else if (P == 2) {
        uint2 v = load_word<SM>(reinterpret_cast<const uint2*>(row + at));
        out[0] = v.x; out[1 % P] = v.y;
    } else {
        out[0] = load_word<SM>(row + at);
    }
}

// Words of x (8 inputs each) a thread stages a pass. A block runs its staging code once, all of
// it fetched cold, so the shortest code wins over more loads in flight, even for a large K.
#define VEC_X_WORDS 1

// Where the single-row kernel reads its weights: straight from global memory (one tile per
// block), a tile staged in shared memory by bulk copies before the wait (one tile per block,
// one wave), or a ring of tiles in shared memory refilled while the block works through the
// tiles blockIdx.x, blockIdx.x + gridDim.x, … (launches of more than one wave).
#define VEC_GLOBAL 0
#define VEC_STAGED 1
#define VEC_RING 2

// Staged tiles of 16·T rows come in two layouts (`runs`):
// - runs (one-wave launches): 8 runs of 2·T consecutive rows, lane gid of the mma holding rows
//   2T·gid + s (s = 0 .. 2T−1 over its row sets), one row of each run. A run's words (2·T rows
//   of nw = K/8) are followed by 4·P words of padding (G/8, P = G/32 words a lane loads at once),
//   its scales and its biases (2·T rows of ng) by 16 bytes each (VEC_SCALE_PAD values of aff_t).
//   A load's lanes (gid, t) then read words gid·(2T·nw + G/8) + s·nw + t·P .. + P − 1: the lanes
//   served together (8 of 16-byte loads, 16 of 8-byte, 32 of 4-byte: gid < 8/P) cover the 32
//   banks once when nw % 32 == 0, and lanes t = 0 read their scales from 8 distinct banks (runs
//   of scales a multiple of 32 bytes plus the 16 of padding apart, whatever sizeof(aff_t)). Lane
//   gid's run is copied by lane gid of warp 0: 24 bulk copies a tile where one a padded row took
//   16·T + 2. The scales are padded too: unpadded, their reads conflict 8 ways, which costs more
//   than the padding.
// - whole (the ring): the tile's rows nw words apart, lane gid holding rows 16i + gid and
//   16i + gid + 8, the words one bulk copy, the scales and biases one each. The rows of one load
//   share banks, which costs the ring less than more copies (a copy a padded row, or the runs).
__device__ __forceinline__ int vec_run_words(int K, int G, int T) {
    return 2 * T * (K / 8) + G / 8;
}

// Values of aff_t padding a run's scales (and its biases): 16 bytes.
#define VEC_SCALE_PAD (16 / (int)sizeof(aff_t))

__device__ __forceinline__ int vec_run_scales(int K, int G, int T) {
    return 2 * T * (K / G) + VEC_SCALE_PAD;
}

// Where row r of a staged tile starts: its words from the tile's start, its scales (and biases)
// from the start of the tile's scales (biases).
__device__ __forceinline__ int vec_row_at(int r, int K, int G, int T, bool runs) {
    return runs ? r / (2 * T) * vec_run_words(K, G, T) + r % (2 * T) * (K / 8) : r * (K / 8);
}

__device__ __forceinline__ int vec_scale_at(int r, int K, int G, int T, bool runs) {
    return runs ? r / (2 * T) * vec_run_scales(K, G, T) + r % (2 * T) * (K / G) : r * (K / G);
}

// Words of one staged tile of 16·T rows, then the aff_t values of its scales (and of its biases,
// which follow them).
__device__ __forceinline__ int vec_tile_words(int K, int G, int T, bool runs) {
    return runs ? 8 * vec_run_words(K, G, T) : 16 * T * (K / 8);
}

__device__ __forceinline__ int vec_tile_scales(int K, int G, int T, bool runs) {
    return runs ? 8 * vec_run_scales(K, G, T) : 16 * T * (K / G);
}

// Bytes of one staged tile: the words, the scales, the biases (sizeof(aff_t) bytes each; a
// multiple of 16 bytes when ng · sizeof(aff_t) is).
__device__ __forceinline__ int vec_tile_bytes(int K, int G, int T, bool runs) {
    return vec_tile_words(K, G, T, runs) * 4 + vec_tile_scales(K, G, T, runs) * (2 * (int)sizeof(aff_t));
}

// Rows n0 .. n0 + rows of W, S and B into the staged tile at `tw` in the `runs` or whole layout,
// completing on `bar`. Warp 0. A row brings K/2 bytes of words and ng · sizeof(aff_t) each of
// scales and biases.
__device__ __forceinline__ void vec_fill(const unsigned* W, const aff_t* S, const aff_t* Bs, int K, int G,
                                         int T, int n0, int rows, unsigned* tw, unsigned long long* bar, int lane,
                                         bool runs) {
    const int nw = K / 8, ng = K / G;
    aff_t* ts = reinterpret_cast<aff_t*>(tw + vec_tile_words(K, G, T, runs));
    aff_t* tb = ts + vec_tile_scales(K, G, T, runs);
    if (lane == 0) mbar_expect_tx(bar, (unsigned)rows * (K / 2 + ng * (2 * (int)sizeof(aff_t))));
    __syncwarp();
    const int r0 = runs ? lane * 2 * T : 0, n = runs ? min(2 * T, rows - r0) : rows;
    if ((runs ? lane < 8 : lane == 0) && n > 0) {
        const long long m = n0 + r0;
        bulk_to_smem(tw + lane * vec_run_words(K, G, T), W + m * nw, n * K / 2, bar);
        bulk_to_smem(ts + lane * vec_run_scales(K, G, T), S + m * ng, n * ng * (int)sizeof(aff_t), bar);
        bulk_to_smem(tb + lane * vec_run_scales(K, G, T), Bs + m * ng, n * ng * (int)sizeof(aff_t), bar);
    }
}

template <int P, int T, int MODE, bool C8, int NW, int RM>
__device__ void mma_vec_t(const unsigned* __restrict__ W, const aff_t* __restrict__ S,
                          const aff_t* __restrict__ Bs, const float* x, float* __restrict__ y,
                          int N, int K, const float* __restrict__ bias, const VecIo& io, int nbuf,
                          float (*red)[64 * RM]) {
    constexpr bool SM = MODE != VEC_GLOBAL;
    // Groups in flight per warp iteration when streaming from global memory: 2·T·P·U ≤ 24 words
    // per lane (at most 4 groups). From shared memory (staged, ring) one group an iteration: a
    // warp runs through its products once, so every instruction of an unrolled body is fetched
    // cold: the staged launches stall on instruction fetch, and shorter code wins.
    constexpr int U_FIT = 12 / (T * P);
    constexpr int U = SM ? 1 : U_FIT < 1 ? 1 : U_FIT > 4 ? 4 : U_FIT;
    extern __shared__ __align__(16) unsigned char vec_smem[];
    // With 8-bit codes K and G count digits, two per input (see the header): x has K / 2 inputs.
    const int G = 32 * P, nw = K / 8, ng = K / G, k_in = C8 ? K / 2 : K;
    // Input rows: one, or io.rows (at most RM) of them io.x_stride floats apart.
    const int R = RM == 1 ? 1 : io.rows;
    const long long xst = RM == 1 ? 0 : io.x_stride;
    uint4* xs = reinterpret_cast<uint4*>(vec_smem);                        // [R][nw][2]: hi, lo pairs
    float* gs = reinterpret_cast<float*>(vec_smem + (size_t)R * nw * 32);  // [R][ng] group sums of x
    float* gh = gs + R * ng;                                               // [R][ng] of hi + lo
    const int tid = threadIdx.x, v = tid >> 5, lane = tid & 31, gid = lane >> 2, t = lane & 3;
    // Outputs of a tile: R rows of 16·T, row-major in the partial sums (red). With one row the
    // row indices below are constants, so the one-row entries' code is that of one row alone.
    const int E = 16 * T * R;
    const int tr = RM == 1 ? 0 : t;  // the input row lane t folds
    // One-wave launches stage their tiles in runs, the ring whole (see vec_run_words).
    constexpr bool RUNS = MODE == VEC_STAGED;
    const int ntiles = (N + 16 * T - 1) / (16 * T);
    // Staged tiles (SM): nbuf of them after the staged x, then one barrier each.
    unsigned char* tiles0 = vec_smem + vec_stage_bytes(K, ng, R);
    const int tile_bytes = vec_tile_bytes(K, G, T, RUNS);
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(tiles0 + (size_t)nbuf * tile_bytes);
    const int step = MODE == VEC_RING ? gridDim.x : ntiles;

    int tile = blockIdx.x, n0 = tile * 16 * T;
    // The lane's rows row0, row1 of the tile at n0 as offsets from n0, the same clamped to N − 1
    // (o0, o1), and where the tile is read: the global matrix, or staged tile `buf` (vec_row_at).
    int row0[T], row1[T], o0[T], o1[T];
#pragma unroll
    for (int i = 0; i < T; ++i) {
        row0[i] = RUNS ? 2 * T * gid + 2 * i : 16 * i + gid;
        row1[i] = RUNS ? 2 * T * gid + 2 * i + 1 : 16 * i + gid + 8;
    }
    const unsigned* wt = W;
    const aff_t* sc = S;
    const aff_t* bi = Bs;
    auto locate = [&](int buf) {
#pragma unroll
        for (int i = 0; i < T; ++i) {
            o0[i] = min(row0[i], N - 1 - n0);
            o1[i] = min(row1[i], N - 1 - n0);
        }
        if (SM) {
            wt = reinterpret_cast<const unsigned*>(tiles0 + (size_t)buf * tile_bytes);
            sc = reinterpret_cast<const aff_t*>(wt + vec_tile_words(K, G, T, RUNS));
            bi = sc + vec_tile_scales(K, G, T, RUNS);
        } else {
            wt = W + (long long)n0 * nw;
            sc = S + (long long)n0 * ng;
            bi = Bs + (long long)n0 * ng;
        }
    };
    unsigned q0[U][T][P], q1[U][T][P];
    auto load_groups = [&](int gb) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int g = gb + NW * u;
            if (g < ng) {
                long long at = (long long)g * (G / 8) + t * P;
#pragma unroll
                for (int i = 0; i < T; ++i) {
                    load_words<P, SM>(wt + vec_row_at(o0[i], K, G, T, RUNS), at, q0[u][i]);
                    load_words<P, SM>(wt + vec_row_at(o1[i], K, G, T, RUNS), at, q1[u][i]);
                }
            }
        }
    };
    locate(0);
    if (SM) {
        // Weights never depend on an earlier kernel: the copies of the block's first tiles are
        // issued before the wait, so they fill while the kernels before still run.
        if (tid == 0)
            for (int b = 0; b < nbuf; ++b) mbar_init(&bars[b]);
        __syncthreads();
        if (v == 0)
            for (int b = 0; b < nbuf && tile + b * step < ntiles; ++b) {
                const int m0 = (tile + b * step) * 16 * T;
                vec_fill(W, S, Bs, K, G, T, m0, min(16 * T, N - m0),
                         reinterpret_cast<unsigned*>(tiles0 + (size_t)b * tile_bytes), &bars[b], lane, RUNS);
            }
    } else {
        // The words of the warp's first U groups go out before the wait too, and the block's
        // scales and biases (used once per group by lanes t = 0) are asked of L1.
        load_groups(v);
        const int rows = min(16 * T, N - n0);
        l1_prefetch_range(S + (long long)n0 * ng, (long long)rows * ng * (long long)sizeof(aff_t), tid, blockDim.x);
        l1_prefetch_range(Bs + (long long)n0 * ng, (long long)rows * ng * (long long)sizeof(aff_t), tid, blockDim.x);
    }
    // The conv epilogue's weights and state are not written by the kernel before (the state
    // by this layer's step of the token before): asked of L1 now. (No conv with a ring: the host
    // fuses it only into single-wave launches.)
    const int conv_rows = io.conv_c > 0 ? max(0, min(min(16 * T, N - n0), io.conv_c - n0)) : 0;
    float* conv_st = io.conv_state + (conv_rows ? (long long)io.slots[0] * (io.conv_k - 1) * io.conv_c : 0);
    if (tid < conv_rows) {
        l1_prefetch(io.conv_w + (long long)(n0 + tid) * io.conv_k);
        for (int j = 0; j + 1 < io.conv_k; ++j) l1_prefetch(conv_st + (long long)j * io.conv_c + n0 + tid);
    }
    if (io.norm)
        for (int k = tid * 32; k < k_in; k += 32 * blockDim.x) l1_prefetch(io.norm + k);
    pdl_entry();
    // A one-tile block's residual rows (y of `accumulate`; thread r adds row r) are copied into
    // shared memory now, under the staging and the products, rather than loaded after them: one
    // round trip to L2 fewer on the way out, and no register held.
    float* y_old = red[NW];
    const int y_row = RM == 1 ? 0 : tid / (16 * T), y_at = tid - y_row * 16 * T;
    if (MODE != VEC_RING && io.accumulate && tid < E && n0 + y_at < N) {
        cp_async4(&y_old[tid], y + (long long)y_row * N + n0 + y_at);
        cp_async_commit();
    }

    // With an input norm, x·norm is staged and x's sum of squares taken on the way; the row's
    // factor r scales the outputs (Σ_k W[n, k]·x[k]·r·norm[k] = r·Σ_k W[n, k]·x[k]·norm[k]).
    // The squares go through explicit fmas, as the epilogue's scaling does: left to
    // contraction, code around them decides the rounding, and the several-row entries must
    // round as the one-row ones.
    // A thread stages VEC_X_WORDS words of x a pass (one pass when the block has a thread per
    // word). A group's G/8 words sit on consecutive lanes of one warp, which sum them by
    // shuffles; lanes past the last word take part with zeros.
    __shared__ float ssq[RM][NW];
    const int wpg = G / 8;
    for (int r = 0; r < R; ++r) {
        const float* xr = x + r * xst;
        uint4* xsr = xs + (size_t)r * 2 * nw;
        float *gsr = gs + r * ng, *ghr = gh + r * ng;
        float ss = 0.f;
        for (int wb = tid; wb - lane < nw; wb += VEC_X_WORDS * blockDim.x) {
            float4 xa[VEC_X_WORDS], xb[VEC_X_WORDS];
    #pragma unroll
            for (int u = 0; u < VEC_X_WORDS; ++u) {
                const int w = wb + u * blockDim.x;
                xa[u] = xb[u] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (w < nw && C8) {
                    xa[u] = *reinterpret_cast<const float4*>(xr + 4 * w);
                } else if (w < nw) {
                    xa[u] = *reinterpret_cast<const float4*>(xr + 8 * w);
                    xb[u] = *reinterpret_cast<const float4*>(xr + 8 * w + 4);
                }
            }
    #pragma unroll
            for (int u = 0; u < VEC_X_WORDS; ++u) {
                const int w = wb + u * blockDim.x;
                if (w - lane >= nw) break;
                float4 a = xa[u], b = xb[u];
                if (io.norm && w < nw && C8) {
                    ss = fmaf(a.w, a.w, fmaf(a.z, a.z, fmaf(a.y, a.y, fmaf(a.x, a.x, ss))));
                    const float4 sa = *reinterpret_cast<const float4*>(io.norm + 4 * w);
                    a = make_float4(a.x * sa.x, a.y * sa.y, a.z * sa.z, a.w * sa.w);
                } else if (io.norm && w < nw) {
                    ss = fmaf(a.w, a.w, fmaf(a.z, a.z, fmaf(a.y, a.y, fmaf(a.x, a.x, ss))));
                    ss = fmaf(b.w, b.w, fmaf(b.z, b.z, fmaf(b.y, b.y, fmaf(b.x, b.x, ss))));
                    const float4 sa = *reinterpret_cast<const float4*>(io.norm + 8 * w);
                    const float4 sb = *reinterpret_cast<const float4*>(io.norm + 8 * w + 4);
                    a = make_float4(a.x * sa.x, a.y * sa.y, a.z * sa.z, a.w * sa.w);
                    b = make_float4(b.x * sb.x, b.y * sb.y, b.z * sb.z, b.w * sb.w);
                }
                // The bias term's sum of the word's inputs (with 8-bit codes the 4 inputs, before they
                // are spread over the digits: x_i meets the low digit, 16·x_i the high one).
                float sum = ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
                if (C8) {
                    b = make_float4(a.z, 16.f * a.z, a.w, 16.f * a.w);
                    a = make_float4(a.x, 16.f * a.x, a.y, 16.f * a.y);
                }
                float lo4[4] = {a.x, a.y, a.z, a.w}, hi4[4] = {b.x, b.y, b.z, b.w};
                unsigned h[4], l[4];
    #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    h[i] = pack_bf16(lo4[i], hi4[i]);
                    l[i] = pack_bf16(lo4[i] - bf16lo(h[i]), hi4[i] - bf16hi(h[i]));
                }
                if (w < nw) {
                    xsr[2 * w] = make_uint4(h[0], h[1], h[2], h[3]);
                    xsr[2 * w + 1] = make_uint4(l[0], l[1], l[2], l[3]);
                }
                float sum_hl = 0.f;
    #pragma unroll
                for (int i = 0; i < 4; ++i) sum_hl += (bf16lo(h[i]) + bf16hi(h[i])) + (bf16lo(l[i]) + bf16hi(l[i]));
                for (int o = 1; o < wpg; o <<= 1) {
                    sum += __shfl_xor_sync(0xffffffffu, sum, o);
                    sum_hl += __shfl_xor_sync(0xffffffffu, sum_hl, o);
                }
                if (w < nw && w % wpg == 0) {
                    gsr[w / wpg] = sum;
                    ghr[w / wpg] = sum_hl;
                }
            }
        }
        // The warps' sums of squares meet in shared memory with the staged x.
        if (io.norm) {
            ss = warp_sum(ss);
            if (lane == 0) ssq[r][v] = ss;
        }
    }
    __syncthreads();
    float r_norm[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        r_norm[r] = 1.f;
        if (io.norm && r < R) {
            float total = 0.f;
#pragma unroll
            for (int i = 0; i < NW; ++i) total += ssq[r][i];
            r_norm[r] = rsqrtf(total / k_in + io.eps);
        }
    }
    // Lanes gid < 2R feed B's columns: column 2r is row r's x_hi, column 2r + 1 its x_lo.
    const uint4* xl = RM == 1 ? xs + gid : xs + (size_t)(gid >> 1) * 2 * nw + (gid & 1);

    // With `best`: this thread's largest output and its row (rows come in increasing order).
    float best_v = NEG_INF;
    int best_i = N;
    for (int it = 0; tile < ntiles; ++it, tile += step) {
        const int buf = MODE == VEC_RING ? it % nbuf : 0;
        if (it > 0) {
            n0 = tile * 16 * T;
            locate(buf);
        }
        if (SM) {
            mbar_wait(&bars[buf], (it / nbuf) & 1);
            load_groups(v);
        }
        float acc0[T], acc1[T];
#pragma unroll
        for (int i = 0; i < T; ++i) acc0[i] = acc1[i] = 0.f;
        for (int gb = v; gb < ng; gb += NW * U) {
            if (gb != v) load_groups(gb);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int g = gb + NW * u;
                if (g >= ng) break;
                float c[T][4];
#pragma unroll
                for (int i = 0; i < T; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
#pragma unroll
                for (int j = 0; j < P; ++j) {
                    int wpos = g * (G / 8) + t * P + j;
                    // Column 2r of B is row r's x_hi (lanes gid = 2r), column 2r + 1 its x_lo: one
                    // product takes both halves of every row.
                    uint4 xb = make_uint4(0u, 0u, 0u, 0u);
                    if (gid < 2 * R) xb = xl[2 * wpos];
#pragma unroll
                    for (int st = 0; st < 2; ++st) {
                        unsigned b0 = st == 0 ? xb.x : xb.z, b1 = st == 0 ? xb.y : xb.w;
#pragma unroll
                        for (int i = 0; i < T; ++i) {
                            unsigned a0 = nib_pair(q0[u][i][j], 2 * st), a1 = nib_pair(q1[u][i][j], 2 * st);
                            unsigned a2 = nib_pair(q0[u][i][j], 2 * st + 1), a3 = nib_pair(q1[u][i][j], 2 * st + 1);
                            mma_bf16(c[i], a0, a1, a2, a3, b0, b1);
                        }
                    }
                }
                // Lane t holds columns 2t and 2t + 1 of D: row t's sums.
                if (t < R) {
                    float xg = gs[tr * ng + g], off = 128.f * gh[tr * ng + g];
#pragma unroll
                    for (int i = 0; i < T; ++i) {
                        const int a0 = vec_scale_at(o0[i], K, G, T, RUNS) + g;
                        const int a1 = vec_scale_at(o1[i], K, G, T, RUNS) + g;
                        // The scale read twice: one load (the compiler merges them), and the bf16
                        // build keeps the order of its loads.
                        acc0[i] = fmaf(aff_scale(sc[a0]), (c[i][0] + c[i][1]) - off,
                                       fmaf(aff_bias(bi[a0], aff_scale(sc[a0])), xg, acc0[i]));
                        acc1[i] = fmaf(aff_scale(sc[a1]), (c[i][2] + c[i][3]) - off,
                                       fmaf(aff_bias(bi[a1], aff_scale(sc[a1])), xg, acc1[i]));
                    }
                }
            }
        }
        // The ring alternates two sets of partial sums, so warps start the next tile while the
        // first threads still add up this one's (one barrier a tile).
        float(*rd)[64 * RM] = MODE == VEC_RING ? red + (it & 1) * 8 : red;
        if (t < R) {
#pragma unroll
            for (int i = 0; i < T; ++i) {
                rd[v][tr * 16 * T + row0[i]] = acc0[i];
                rd[v][tr * 16 * T + row1[i]] = acc1[i];
            }
        }
        __syncthreads();
        // Every warp is past this tile's words: the ring refills the buffer with the tile nbuf
        // steps on (the proxy fence orders the generic reads before the bulk writes).
        if (MODE == VEC_RING && v == 0 && tile + nbuf * step < ntiles) {
            fence_proxy_async();
            const int m0 = (tile + nbuf * step) * 16 * T;
            vec_fill(W, S, Bs, K, G, T, m0, min(16 * T, N - m0),
                     reinterpret_cast<unsigned*>(tiles0 + (size_t)buf * tile_bytes), &bars[buf], lane, RUNS);
        }
        // In the ring every warp adds up 2·T·R of the outputs, so no warp starts the next tile
        // late. Output e is row e / (16·T), weight row n0 + e % (16·T).
        const int e0 = MODE == VEC_RING ? (lane < 2 * T * R ? v * 2 * T * R + lane : E) : tid;
        for (int e = e0; e < E; e += blockDim.x) {
            const int row = RM == 1 ? 0 : e / (16 * T), r = e - row * 16 * T;
            if (n0 + r < N) {
                float sum = 0.f;
#pragma unroll
                for (int i = 0; i < NW; ++i) sum += rd[i][e];
                float rn = r_norm[0];
#pragma unroll
                for (int i = 1; i < RM; ++i)
                    if (row == i) rn = r_norm[i];
                // One explicit fma: left to contraction, the one-row and several-row entries
                // rounded this differently.
                float out = fmaf(sum, rn, bias ? bias[n0 + r] : 0.f);
                float* yo = y + (long long)row * N + n0 + r;
                if (io.accumulate && MODE == VEC_RING) out = *yo + out;
                if (io.accumulate && MODE != VEC_RING) {
                    cp_async_wait_all();
                    out = y_old[e] + out;
                }
                *yo = out;
                if (MODE == VEC_RING && out > best_v) {
                    best_v = out;
                    best_i = n0 + r;
                }
                if (r < conv_rows) {
                    float wv[CONV_KMAX], sv[CONV_KMAX];
                    conv_load(io.conv_w, conv_st, n0 + r, io.conv_c, io.conv_k, wv, sv);
                    io.mixed[n0 + r] = conv_advance(wv, sv, conv_st, n0 + r, io.conv_c, io.conv_k, out);
                }
            }
        }
        if (MODE != VEC_RING) break;
    }
    if (MODE == VEC_RING && io.best) {
        block_argmax(best_v, best_i);
        if (tid == 0) {
            io.best[2 * blockIdx.x] = best_v;
            io.best[2 * blockIdx.x + 1] = __int_as_float(best_i);
        }
    }
    if (io.norm && io.normed && blockIdx.x == 0)
#pragma unroll
        for (int r = 0; r < RM; ++r)
            if (r < R)
                for (int k = tid; k < k_in; k += blockDim.x)
                    io.normed[r * k_in + k] = x[r * xst + k] * r_norm[r] * io.norm[k];
}

// The group's digit count picks P (G = 32·P digits); 8-bit codes take groups of 32 or 64 inputs
// (G = 64 or 128 digits). G16: the entries for 8-bit codes in groups of 16 (G = 32 digits;
// GGUF's Q6_K), which exist in the AFFINE_F32 build only and whose own entries keep the other
// entries' code as it is.
template <int T, int MODE, bool C8, int NW, int RM, bool G16>
__device__ __forceinline__ void vec_dispatch(const unsigned* W, const aff_t* S, const aff_t* B, const float* x,
                                             float* y, int N, int K, int G, const float* bias, const VecIo& io,
                                             int nbuf, float (*red)[64 * RM]) {
    if constexpr (G16) mma_vec_t<1, T, MODE, C8, NW, RM>(W, S, B, x, y, N, K, bias, io, nbuf, red);
    else if (G == 128) mma_vec_t<4, T, MODE, C8, NW, RM>(W, S, B, x, y, N, K, bias, io, nbuf, red);
    else if (G == 64) mma_vec_t<2, T, MODE, C8, NW, RM>(W, S, B, x, y, N, K, bias, io, nbuf, red);
    else if constexpr (!C8) mma_vec_t<1, T, MODE, C8, NW, RM>(W, S, B, x, y, N, K, bias, io, nbuf, red);
}

template <int MODE, bool C8, int NW, int RM, bool G16>
__device__ __forceinline__ void vec_tiles(const unsigned* W, const aff_t* S, const aff_t* B, const float* x,
                                          float* y, int N, int K, int G, int tiles, const float* bias,
                                          const VecIo& io, float (*red)[64 * RM]) {
    if (tiles == 4) vec_dispatch<4, MODE, C8, NW, RM, G16>(W, S, B, x, y, N, K, G, bias, io, 1, red);
    else if (tiles == 3) vec_dispatch<3, MODE, C8, NW, RM, G16>(W, S, B, x, y, N, K, G, bias, io, 1, red);
    else if (tiles == 2) vec_dispatch<2, MODE, C8, NW, RM, G16>(W, S, B, x, y, N, K, G, bias, io, 1, red);
    else vec_dispatch<1, MODE, C8, NW, RM, G16>(W, S, B, x, y, N, K, G, bias, io, 1, red);
}

// Row tiles of 16 per tile of the ring kernel.
#define VEC_RING_TILES 2

// Input rows the _rows entries take at most (VEC_MAX_ROWS in cuda/vec.rs).
#define VEC_MAX_ROWS 4

// A streamed entry of NW warps a block (MINB blocks an SM), for RM input rows at most: its first
// blocks ask L2 for their rows (K/2 bytes a row of words: K digits of 4 bits; K/G · sizeof(aff_t)
// of scales and of biases) before mma_vec_t waits for the kernel before (pdl_entry) after its
// first weight loads.
#define VEC_GLOBAL_ENTRY(NAME, C8, NW, MINB, RM, G16)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * NW, MINB) NAME(                                               \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B, const float* x,   \
        float* __restrict__ y, int N, int K, int G, int tiles, const float* __restrict__ bias, const VecIo io) {    \
        long long n0 = (long long)blockIdx.x * 16 * tiles;                                                          \
        l2_prefetch_rows(W, n0, 16 * tiles, N, K / 2, blockIdx.x);                                                  \
        l2_prefetch_rows(S, n0, 16 * tiles, N, K / G * (int)sizeof(aff_t), blockIdx.x);                             \
        l2_prefetch_rows(B, n0, 16 * tiles, N, K / G * (int)sizeof(aff_t), blockIdx.x);                             \
        __shared__ float red[NW + 1][64 * RM];                                                                      \
        vec_tiles<VEC_GLOBAL, C8, NW, RM, G16>(W, S, B, x, y, N, K, G, tiles, bias, io, red);                       \
    }

// A staged entry (_staged, _staged16) of NW warps a block.
#define VEC_STAGED_ENTRY(NAME, C8, NW, RM, G16)                                                                           \
    extern "C" __global__ void __maxnreg__(96) NAME(                                                                \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B, const float* x,   \
        float* __restrict__ y, int N, int K, int G, int tiles, const float* __restrict__ bias, const VecIo io) {    \
        __shared__ float red[NW + 1][64 * RM];                                                                      \
        vec_tiles<VEC_STAGED, C8, NW, RM, G16>(W, S, B, x, y, N, K, G, tiles, bias, io, red);                       \
    }

// The ring entry (the ring alternates two sets of sums of 8 warps).
#define VEC_RING_ENTRY(NAME, C8, RM, G16)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(                                                      \
        const unsigned* __restrict__ W, const aff_t* __restrict__ S, const aff_t* __restrict__ B, const float* x,   \
        float* __restrict__ y, int N, int K, int G, const float* __restrict__ bias, const VecIo io, int nbuf) {     \
        __shared__ float red[16][64 * RM];                                                                          \
        vec_dispatch<VEC_RING_TILES, VEC_RING, C8, 8, RM, G16>(W, S, B, x, y, N, K, G, bias, io, nbuf, red);       \
    }

// The entries for 4-bit (C8 false) and 8-bit codes (K and G in digits, twice the inputs).
//
// mma_vec_affine{BITS}: tiles row tiles of 16 per block (1 to 4), rows streamed from global memory.
//
// mma_vec_affine{BITS}_staged: the block's rows of W, S and B staged in shared memory by bulk
// copies issued before the wait (one launch wave: every block resident while the kernel before
// runs). Needs K/G · sizeof(aff_t) % 16 == 0 (the scale rows copied whole 16-byte units: K/G % 8
// == 0 for 2-byte parameters, % 4 for f32) and 16-byte aligned matrices. 96 registers: two
// blocks an SM then leave 16K registers, room for a 256-thread block of the next kernel at 64
// (the GDN step after the input projection) to become resident and load its state before its
// wait. At the 128 that two blocks allow nothing else fits; fewer than 96 spill.
//
// mma_vec_affine{BITS}_staged16: as _staged in blocks of 16 warps (512 threads, one block an SM
// at 96 registers with room for 16K more), for a launch of at most one block per SM: each warp
// then takes half the groups, which halves the chain of products on a block's critical path (the
// router's 17 blocks, a GDN or attention output projection's 128 on the 35B shape), where the
// SM's other warps would idle.
//
// mma_vec_affine{BITS}_ring: as _staged for a launch of more row tiles than blocks: block b works
// through tiles b, b + gridDim.x, … of VEC_RING_TILES row tiles each from a ring of `nbuf` staged
// tiles, each refilled by bulk copies as soon as the block is past it (no conv epilogue). The
// input is staged once per block.
//
// mma_vec_rows_affine{BITS}{,_staged,_ring,_staged16,_streamed16}: the same forms for io.rows
// input rows (1 to VEC_MAX_ROWS) through the one matrix (no conv epilogue, no `best`), and a
// streamed form in 16-warp blocks for the launches whose one-row form is _staged16 but whose rows
// do not fit its shared memory: each row's sums meet in the one-row form's order, so every row is
// bitwise what its one-row launch gives.
//
// red: the NW warps' sums of the block's rows, then the residual rows of `accumulate`.
//
// The registry (cuda/kernels.rs) compiles this file once per part, the parts in parallel (all
// entries in one compile were the longest compile of a first start): VEC_PART_BITS 4 or 8, or 16
// for the 8-bit entries in groups of 16 (the f32 build's _g16 ones); VEC_PART_ROWS 0 for the
// one-row entries, 1 for the several-row ones.
#define VEC_ONE_ENTRIES(BITS, C8, TAIL, G16)                                                                         \
    VEC_GLOBAL_ENTRY(mma_vec_affine##BITS##TAIL, C8, 8, 2, 1, G16)                                                  \
    VEC_STAGED_ENTRY(mma_vec_affine##BITS##_staged##TAIL, C8, 8, 1, G16)                                            \
    VEC_STAGED_ENTRY(mma_vec_affine##BITS##_staged16##TAIL, C8, 16, 1, G16)                                         \
    VEC_RING_ENTRY(mma_vec_affine##BITS##_ring##TAIL, C8, 1, G16)
#define VEC_ROWS_ENTRIES(BITS, C8, TAIL, G16)                                                                        \
    VEC_GLOBAL_ENTRY(mma_vec_rows_affine##BITS##TAIL, C8, 8, 2, VEC_MAX_ROWS, G16)                                  \
    VEC_STAGED_ENTRY(mma_vec_rows_affine##BITS##_staged##TAIL, C8, 8, VEC_MAX_ROWS, G16)                            \
    VEC_STAGED_ENTRY(mma_vec_rows_affine##BITS##_staged16##TAIL, C8, 16, VEC_MAX_ROWS, G16)                         \
    VEC_RING_ENTRY(mma_vec_rows_affine##BITS##_ring##TAIL, C8, VEC_MAX_ROWS, G16)                                   \
    VEC_GLOBAL_ENTRY(mma_vec_rows_affine##BITS##_streamed16##TAIL, C8, 16, 1, VEC_MAX_ROWS, G16)

#if VEC_PART_ROWS
#define VEC_PART_ENTRIES VEC_ROWS_ENTRIES
#else
#define VEC_PART_ENTRIES VEC_ONE_ENTRIES
#endif

#if VEC_PART_BITS == 4
VEC_PART_ENTRIES(4, false, , false)
#elif VEC_PART_BITS == 8
VEC_PART_ENTRIES(8, true, , false)
#elif VEC_PART_BITS == 16 && AFFINE_G16
VEC_PART_ENTRIES(8, true, _g16, true)
#endif
