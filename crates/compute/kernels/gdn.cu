// Gated DeltaNet decode step (one token), f32 state.
//
// The layer's fused input projection gives proj = [qkv (C = 2·Hk·Dk + Hv·Dv) | z (Hv·Dv) | b (Hv) | a (Hv)].
//
// gdn_conv_step: mixed[c] = silu(Σ_{j<K-1} w[c, j] · state[j, c] + w[c, K-1] · proj[c]), then the
//   conv state [K-1, C] (oldest first) shifts by one and takes proj[c]. w: [C, K]. grid ceil(C/256), block 256.
//
// gdn_step: one block per value head h (block = Dv threads rounded up to a multiple of 32);
//   kh = h / (Hv / Hk); q, k = l2norm(mixed q/k of kh) (eps 1e-6), q ·= 1/sqrt(Dk); v = mixed v of h;
//   g = neg_a[h] · softplus(a[h] + dt_bias[h]); β = sigmoid(b[h]); state S_h: [Dk, Dv].
//   Thread j owns column j of S_h in registers: S ← e^g S; δ_j = β (v_j − Σ_i k_i S_ij);
//   S_ij += k_i δ_j; o_j = Σ_i q_i S_ij; then the gated RMSNorm out_j = o_j / rms(o) · w_j · silu(z_j).
//   Dk ≤ GDN_DK_MAX.
#define GDN_DK_MAX 128

extern "C" __global__ void gdn_conv_step(const float* __restrict__ proj, float* __restrict__ state,
                                         const float* __restrict__ w, float* __restrict__ mixed,
                                         int C, int K) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const float* wc = w + (long long)c * K;
    float x = proj[c];
    float acc = wc[K - 1] * x;
    for (int j = 0; j < K - 1; ++j) acc = fmaf(wc[j], state[(long long)j * C + c], acc);
    for (int j = 0; j + 1 < K - 1; ++j) state[(long long)j * C + c] = state[(long long)(j + 1) * C + c];
    if (K > 1) state[(long long)(K - 2) * C + c] = x;
    mixed[c] = silu_f(acc);
}

extern "C" __global__ void gdn_step(const float* __restrict__ mixed, const float* __restrict__ proj,
                                    float* __restrict__ state, const float* __restrict__ neg_a,
                                    const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
                                    float* __restrict__ out, int Hk, int Hv, int Dk, int Dv, float eps) {
    __shared__ float qs[GDN_DK_MAX];
    __shared__ float ks[GDN_DK_MAX];
    int h = blockIdx.x, j = threadIdx.x;
    int kh = h / (Hv / Hk);
    int C = 2 * Hk * Dk + Hv * Dv;
    const float* q = mixed + kh * Dk;
    const float* k = mixed + Hk * Dk + kh * Dk;
    const float* v = mixed + 2 * Hk * Dk + h * Dv;
    const float* z = proj + C + h * Dv;
    float b = proj[C + Hv * Dv + h];
    float a = proj[C + Hv * Dv + Hv + h];

    float qq = 0.f, kk = 0.f;
    for (int i = j; i < Dk; i += blockDim.x) {
        float qi = q[i], ki = k[i];
        qs[i] = qi;
        ks[i] = ki;
        qq += qi * qi;
        kk += ki * ki;
    }
    float rq = rsqrtf(block_sum(qq) + 1e-6f) * rsqrtf((float)Dk);
    float rk = rsqrtf(block_sum(kk) + 1e-6f);
    float decay = expf(neg_a[h] * softplus_f(a + dt_bias[h]));
    float beta = sigmoid_f(b);

    float o = 0.f;
    if (j < Dv) {
        float* S = state + (long long)h * Dk * Dv + j;
        float col[GDN_DK_MAX];
        float kv = 0.f;
#pragma unroll
        for (int i = 0; i < GDN_DK_MAX; ++i) {
            if (i < Dk) {
                col[i] = S[(long long)i * Dv] * decay;
                kv = fmaf(ks[i] * rk, col[i], kv);
            }
        }
        float delta = beta * (v[j] - kv);
#pragma unroll
        for (int i = 0; i < GDN_DK_MAX; ++i) {
            if (i < Dk) {
                float s = fmaf(ks[i] * rk, delta, col[i]);
                S[(long long)i * Dv] = s;
                o = fmaf(qs[i] * rq, s, o);
            }
        }
    }
    float r = rsqrtf(block_sum(j < Dv ? o * o : 0.f) / Dv + eps);
    if (j < Dv) out[h * Dv + j] = o * r * norm_w[j] * silu_f(z[j]);
}
