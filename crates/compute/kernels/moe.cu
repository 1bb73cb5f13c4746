// MoE routing and combine, decode (one token for each of B rows).
//
// router_topk: per row b, logits_b = logits + b·L: [E] (+ logits_b[E] = shared-expert gate logit
//   when has_shared_gate); outputs ids_b = ids + b·KS, w_b = w + b·KS, sg[b], KS = K + (shared_slot ≥ 0).
//   p = softmax(logits[0..E]); the K largest (ties to the lower index) → ids [K], w [K]
//   (divided by their sum when renorm); sg = sigmoid(logits[E]); when shared_slot ≥ 0 the shared
//   expert is stacked with the routed ones at that index: ids[K] = shared_slot, w[K] = sg.
//   loc (optional, [E]): where each routed expert's weights are (an index into the stacked
//   weights, see matvec.cu's far experts); ids[r] = loc ? loc[expert] : expert.
//   A routed expert whose loc is negative is another GPU's (expert parallel): its id is −1 and
//   its weight 0 (the weights' sum still takes it, so every GPU gets the same weights), and
//   with shared_here 0 the shared slot is so too.
//   host_take (optional, [K + 1]): of a row's c picks with ids ≥ far_from (outside the device
//   cache), the first host_take[c] in rank order are handed to the host instead: id
//   −1 − (id − far_from) (moe.cu's host experts; the host split policy makes the table).
//   One warp per row, no block barriers: lane l takes experts l, l + 32, … (the softmax sum in
//   that order, then the lanes meet); the lanes whose largest logit is among the K largest of
//   the 32 bound the K-th largest p from below by the least of their largest p, and only the
//   experts at or above it are ranked against each other. The picks' sum runs in rank order.
//   grid B, block 32.
//   E ≤ 1024, K ≤ 32.
//
// moe_combine: per row b, delta[b, i] = Σ_k w[b, k] · y[b, k, i] + (ys ? sg[b] · ys[b, i] : 0),
//   or with accumulate delta[b, i] += that sum (the residual add; the same value as
//   moe_combine_norm's x). y: [B, K, H]; w: [B, K]; ys, delta: [B, H]. grid (ceil(H/256), B),
//   block 256.
//
// moe_combine_norm: the same sum per row, added to the residual in place: x += sum ([B, H]),
//   then out = rmsnorm(x) · scale (as norm.cu's add_rmsnorm: the same values in
//   the same order with the same block size). Each thread loads the K terms of two elements and
//   their weights COMBINE_LOADS at a time before summing them in order. grid B, block 1024.

// The largest v of the warp by one redux on an order-preserving integer key (−0 below +0).
__device__ __forceinline__ float warp_max_redux(float v) {
    const int b = __float_as_int(v);
    const int m = __reduce_max_sync(0xffffffffu, b ^ ((b >> 31) & 0x7fffffff));
    return __int_as_float(m ^ ((m >> 31) & 0x7fffffff));
}

extern "C" __global__ void __launch_bounds__(32) router_topk(const float* logits, int E, int K, int renorm,
                                       int has_shared_gate, int shared_slot, int* __restrict__ ids,
                                       float* __restrict__ w, float* __restrict__ sg, long long L,
                                       const int* __restrict__ loc, int far_from,
                                       const int* __restrict__ host_take, int shared_here) {
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x;
    // The table is written once by the host: read before waiting on the kernel before.
    const int take = host_take && lane <= K ? host_take[lane] : 0;
    pdl_entry();
    __shared__ float p[1024];
    __shared__ int cand[1024];
    __shared__ float cval[1024];
    __shared__ float chosen[32];
    __shared__ int chosen_id[32];
    int row = blockIdx.x, KS = K + (shared_slot >= 0);
    logits += row * L;
    ids += row * KS;
    w += row * KS;
    sg += row;
    // The shared gate's logit, loaded with the others rather than after the selection.
    const float gate_logit = has_shared_gate ? logits[E] : 0.f;
    // Lane l takes experts l, l + 32, …: their raw maximum here, then their softmax terms' sum
    // (the lanes then meet: the softmax sum) and maximum.
    float lmax = NEG_INF;
#pragma unroll 8
    for (int e = lane; e < E; e += 32) {
        float v = logits[e];
        p[e] = v;
        lmax = fmaxf(lmax, v);
    }
    const float mx = warp_max_redux(lmax);
    // The lanes whose largest logit is among the K largest of the 32 (at least K lanes, each
    // holding an expert) bound the K-th largest p from below by the least of their largest p:
    // ranked on the logits while the exponentials run (two independent chains), then one redux.
    // The row stays in shared memory: held in registers (128 of them a thread) it is slower. The
    // passes over p are unrolled as the loads are: one warp runs the kernel, so its shared-memory
    // loads and exps otherwise wait one after another.
    int greater = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) greater += __shfl_sync(all, lmax, j) > lmax;
    float part = 0.f, gmax = 0.f;
#pragma unroll 8
    for (int e = lane; e < E; e += 32) {
        float v = expf(p[e] - mx);
        p[e] = v;
        part += v;
        gmax = fmaxf(gmax, v);
    }
    const float sum = warp_sum(part);
    // p ≥ 0: its bits order as unsigned integers.
    const float thr = __uint_as_float(__reduce_min_sync(all, greater < K ? __float_as_uint(gmax) : 0xffffffffu));
    // The candidates, packed 32 experts at a time by ballot (their order does not change the
    // ranks), each with its p beside it.
    int nc = 0;
#pragma unroll 8
    for (int e0 = 0; e0 < E; e0 += 32) {
        const int e = e0 + lane;
        const float v = e < E ? p[e] : 0.f;
        const bool c = e < E && v >= thr;
        const unsigned m = __ballot_sync(all, c);
        if (c) {
            const int at = nc + __popc(m & ((1u << lane) - 1u));
            cand[at] = e;
            cval[at] = v;
        }
        nc += __popc(m);
    }
    __syncwarp();
    // Rank of each candidate among the candidates (the others are all smaller): larger p first,
    // ties to the lower index.
    for (int i = lane; i < nc; i += 32) {
        const int e = cand[i];
        const float v = cval[i];
        int rank = 0;
#pragma unroll 4
        for (int j = 0; j < nc; ++j) {
            const int f = cand[j];
            const float u = cval[j];
            rank += (u > v) | ((u == v) & (f < e));
        }
        if (rank < K) {
            chosen_id[rank] = loc ? loc[e] : e;
            chosen[rank] = v / sum;
        }
    }
    __syncwarp();
    int id = lane < K ? chosen_id[lane] : 0;
    const bool foreign = id < 0;
    {
        const bool far = host_take && lane < K && id >= far_from;
        const unsigned fb = __ballot_sync(all, far);
        const int h = __shfl_sync(all, take, __popc(fb));
        if (far && __popc(fb & ((1u << lane) - 1u)) < h) id = -1 - (id - far_from);
        if (lane < K) ids[lane] = foreign ? -1 : id;
    }
    // The picks' sum in rank order, in every lane.
    const float mine = lane < K ? chosen[lane] : 0.f;
    float total = 0.f;
    for (int r = 0; r < K; ++r) total += __shfl_sync(all, mine, r);
    if (lane < K) w[lane] = foreign ? 0.f : renorm ? mine / total : mine;
    if (lane == 0 && has_shared_gate) {
        float g = sigmoid_f(gate_logit);
        sg[0] = g;
        if (shared_slot >= 0) {
            ids[K] = shared_here ? shared_slot : -1;
            w[K] = shared_here ? g : 0.f;
        }
    }
}

extern "C" __global__ void moe_combine(const float* y, const float* w,
                                       const float* ys, const float* sg,
                                       float* __restrict__ delta, int K, int H, int accumulate) {
    pdl_entry();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= H) return;
    int row = blockIdx.y;
    y += (long long)row * K * H;
    w += row * K;
    if (ys) {
        ys += (long long)row * H;
        sg += row;
    }
    delta += (long long)row * H;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc = fmaf(w[k], y[(long long)k * H + i], acc);
    if (ys) acc = fmaf(sg[0], ys[i], acc);
    delta[i] = accumulate ? delta[i] + acc : acc;
}

// Terms per element loaded before any is summed: Qwen3.6-35B-A3B's 8 routed experts + the shared
// one in one batch (10 + 1 take two); more would spill at 1024 threads' 64 registers.
#define COMBINE_LOADS 9

extern "C" __global__ void __launch_bounds__(1024) moe_combine_norm(const float* y, const float* w,
                                            const float* ys, const float* sg,
                                            float* __restrict__ x, const float* __restrict__ scale,
                                            float* __restrict__ out, int K, int H, float eps) {
    // The norm scale is a weight: asked of L1 before the wait.
    for (int i = threadIdx.x; i < H; i += blockDim.x) l1_prefetch(scale + i);
    pdl_entry();
    int row = blockIdx.x;
    y += (long long)row * K * H;
    w += row * K;
    if (ys) {
        ys += (long long)row * H;
        sg += row;
    }
    x += (long long)row * H;
    out += (long long)row * H;
    float ss = 0.f;
    // Two elements per pass (i, i + blockDim), all their loads (terms, weights, residual) in
    // flight together.
    for (int i = threadIdx.x; i < H; i += 2 * blockDim.x) {
        const int i2 = i + blockDim.x;
        const bool two = i2 < H;
        const float xi = x[i], xi2 = two ? x[i2] : 0.f;
        float acc = 0.f, acc2 = 0.f;
        for (int k0 = 0; k0 < K; k0 += COMBINE_LOADS) {
            float yk[COMBINE_LOADS], yk2[COMBINE_LOADS], wk[COMBINE_LOADS];
#pragma unroll
            for (int u = 0; u < COMBINE_LOADS; ++u)
                if (k0 + u < K) {
                    wk[u] = w[k0 + u];
                    yk[u] = y[(long long)(k0 + u) * H + i];
                    yk2[u] = two ? y[(long long)(k0 + u) * H + i2] : 0.f;
                }
#pragma unroll
            for (int u = 0; u < COMBINE_LOADS; ++u)
                if (k0 + u < K) {
                    acc = fmaf(wk[u], yk[u], acc);
                    acc2 = fmaf(wk[u], yk2[u], acc2);
                }
        }
        if (ys) {
            acc = fmaf(sg[0], ys[i], acc);
            if (two) acc2 = fmaf(sg[0], ys[i2], acc2);
        }
        float v = xi + acc;
        x[i] = v;
        ss += v * v;
        if (two) {
            float v2 = xi2 + acc2;
            x[i2] = v2;
            ss += v2 * v2;
        }
    }
    float r = rsqrtf(block_sum(ss) / H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) out[i] = x[i] * r * scale[i];
}

// Experts computed by the host (expert offload's CPU fallback; see the model's offload module):
// the router writes id −1 − e for an expert e the host computes. The expert kernels skip such
// slots; these two kernels hand the host its inputs and take its outputs back, in one mailbox of
// pinned host memory mapped into the device (layers take turns: the host answers one layer
// before the next can ask).
//
// host_experts_publish: per row b of B: ids[b·KS .. +KS] → box_ids, and when one of them is < 0,
//   x[b, 0..H) → box_x[b]; then the last block to finish bumps the device counter and writes it
//   to box_flags[0] after a system-wide fence, so a host that sees the new number sees the data.
//   state: device [counter, blocks arrived]; box_flags: host [published, answered, failed].
//   grid B, block 256.
extern "C" __global__ void host_experts_publish(const float* x, const int* ids,
                                                int KS, int H, float* box_x, int* box_ids,
                                                unsigned* state, volatile unsigned* box_flags) {
    pdl_entry();
    __shared__ int any;
    const int b = blockIdx.x;
    if (threadIdx.x == 0) any = 0;
    __syncthreads();
    for (int k = threadIdx.x; k < KS; k += blockDim.x) {
        int id = ids[b * KS + k];
        box_ids[b * KS + k] = id;
        if (id < 0) any = 1;
    }
    __syncthreads();
    if (any)
        for (int i = threadIdx.x; i < H; i += blockDim.x) box_x[(long long)b * H + i] = x[(long long)b * H + i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(&state[1], 1u) == gridDim.x - 1) {
        state[1] = 0;
        unsigned s = state[0] + 1;
        state[0] = s;
        __threadfence_system();
        box_flags[0] = s;
    }
}

// How long host_experts_wait waits for the host before it gives up (ns).
#define HOST_WAIT_NS 10000000000ull

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// host_experts_wait: waits until the host has written the device counter's value to
//   box_flags[1] (its outputs for this layer are then in box_y), then per slot s of B·KS whose
//   id < 0 copies box_y[s, 0..H) → y[s]. Block 0 waits even when no slot is the host's, so the
//   host answers every layer in turn and never finds the mailbox holding a later layer's
//   inputs. After HOST_WAIT_NS without an answer, or at once when box_flags[2] is set (by an
//   earlier wait that gave up, or by the host when it failed), it sets box_flags[2] = 1 and
//   leaves y as it is: the host reports the step as failed. grid B·KS, block 256.
extern "C" __global__ void host_experts_wait(const int* ids, const float* box_y, float* __restrict__ y,
                                             int H, const unsigned* state, volatile unsigned* box_flags) {
    pdl_entry();
    __shared__ int ok;
    const int s = blockIdx.x;
    const bool host = ids[s] < 0;
    if (!host && s > 0) return;
    if (threadIdx.x == 0) {
        const unsigned want = state[0];
        const unsigned long long t0 = global_ns();
        ok = 1;
        while (load_acquire_sys((const unsigned*)box_flags + 1) != want) {
            if (box_flags[2] || global_ns() - t0 > HOST_WAIT_NS) {
                box_flags[2] = 1u;
                ok = 0;
                break;
            }
        }
    }
    __syncthreads();
    if (!ok || !host) return;
    for (int i = threadIdx.x; i < H; i += blockDim.x) y[(long long)s * H + i] = __ldcv(box_y + (long long)s * H + i);
}
