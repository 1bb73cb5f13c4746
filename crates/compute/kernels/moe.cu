// MoE routing and combine, decode (one token).
//
// router_topk: logits [E] (+ logits[E] = shared-expert gate logit when has_shared_gate).
//   p = softmax(logits[0..E]); the K largest (ties to the lower index) → ids [K], w [K]
//   (divided by their sum when renorm); sg = sigmoid(logits[E]). grid 1, block 256. K ≤ 32.
//
// moe_combine: delta[i] = Σ_k w[k] · y[k, i] + (ys ? sg · ys[i] : 0). y: [K, H]. grid ceil(H/256), block 256.

extern "C" __global__ void router_topk(const float* __restrict__ logits, int E, int K, int renorm,
                                       int has_shared_gate, int* __restrict__ ids, float* __restrict__ w,
                                       float* __restrict__ sg) {
    __shared__ float p[1024];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ float chosen[32];
    int t = threadIdx.x;
    float mx = NEG_INF;
    for (int e = t; e < E; e += blockDim.x) mx = fmaxf(mx, logits[e]);
    mx = block_max(mx);
    float sum = 0.f;
    for (int e = t; e < E; e += blockDim.x) {
        float v = expf(logits[e] - mx);
        p[e] = v;
        sum += v;
    }
    sum = block_sum(sum);
    for (int r = 0; r < K; ++r) {
        // Block argmax over unselected experts; lowest index wins ties.
        float bv = -1.f;
        int bi = E;
        for (int e = t; e < E; e += blockDim.x) {
            float v = p[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if ((t & 31) == 0) { best_v[t >> 5] = bv; best_i[t >> 5] = bi; }
        __syncthreads();
        if (t == 0) {
            int nw = (blockDim.x + 31) >> 5;
            for (int i = 1; i < nw; ++i)
                if (best_v[i] > best_v[0] || (best_v[i] == best_v[0] && best_i[i] < best_i[0])) {
                    best_v[0] = best_v[i];
                    best_i[0] = best_i[i];
                }
            ids[r] = best_i[0];
            chosen[r] = best_v[0] / sum;
            p[best_i[0]] = -1.f;
        }
        __syncthreads();
    }
    if (t == 0) {
        float s = 0.f;
        for (int r = 0; r < K; ++r) s += chosen[r];
        for (int r = 0; r < K; ++r) w[r] = renorm ? chosen[r] / s : chosen[r];
        if (has_shared_gate) sg[0] = sigmoid_f(logits[E]);
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
