// MoE routing and combine, decode (one token).
//
// router_topk: logits [E] (+ logits[E] = shared-expert gate logit when has_shared_gate).
//   p = softmax(logits[0..E]); the K largest (ties to the lower index) → ids [K], w [K]
//   (divided by their sum when renorm); sg = sigmoid(logits[E]); when shared_slot ≥ 0 the shared
//   expert is stacked with the routed ones at that index: ids[K] = shared_slot, w[K] = sg.
//   grid 1, block 32 (one warp).
//   E ≤ 1024, K ≤ 32.
//
// moe_combine: delta[i] = Σ_k w[k] · y[k, i] + (ys ? sg · ys[i] : 0). y: [K, H]. grid ceil(H/256), block 256.

extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int K, int renorm,
                                       int has_shared_gate, int shared_slot, int* __restrict__ ids,
                                       float* __restrict__ w, float* __restrict__ sg) {
    __shared__ float p[1024];
    int lane = threadIdx.x;
    float mx = NEG_INF;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, logits[e]);
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) {
        float v = expf(logits[e] - mx);
        p[e] = v;
        sum += v;
    }
    sum = warp_sum(sum);
    __syncwarp();
    float chosen = 0.f, total = 0.f;
    for (int r = 0; r < K; ++r) {
        // Warp argmax over unselected experts; lowest index wins ties.
        float bv = -1.f;
        int bi = E;
        for (int e = lane; e < E; e += 32) {
            float v = p[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == r) chosen = bv / sum;
        total += bv / sum;
        if (lane == 0) {
            ids[r] = bi;
            p[bi] = -1.f;
        }
        __syncwarp();
    }
    if (lane < K) w[lane] = renorm ? chosen / total : chosen;
    if (lane == 0 && has_shared_gate) {
        float g = sigmoid_f(logits[E]);
        sg[0] = g;
        if (shared_slot >= 0) {
            ids[K] = shared_slot;
            w[K] = g;
        }
    }
}

extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ w,
                                       const float* __restrict__ ys, const float* __restrict__ sg,
                                       float* __restrict__ delta, int K, int H) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= H) return;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc = fmaf(w[k], y[(long long)k * H + i], acc);
    if (ys) acc = fmaf(sg[0], ys[i], acc);
    delta[i] = acc;
}
