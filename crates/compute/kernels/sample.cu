// Sampling for decode, for a batch of B rows; the token ids, positions and sampling parameters
// live in device memory so a captured graph replays them.
//
// sample_advance: row b (grid B, one block each) belongs to the sequence in slot s = slots[b]; with
//   its parameters params + SAMPLE_WORDS·s and logits + b·V it writes tok[b] and advances pos[s]. With
//   npairs > 0 (one row), the logits' max and its lowest index come from pairs [npairs, 2]: the
//   lm_head's largest output and its row per block (mma_vec.cu, VecIo best).
//   The token is picked from logits[0..V] with the sampling parameters
//   (u32: [temperature bits, top_k, top_p bits, min_p bits, seed lo, seed hi, step]): the argmax
//   (lowest index on ties) when temperature ≤ 0; else with z = (l − max)/T: keep the top_k largest z (0: all), then the
//   smallest set of largest z holding top_p of their mass, then z ≥ ln(min_p) (min-p relative to
//   the most likely token), and draw u·Σ e^z with u uniform from (seed, step) over the kept tokens
//   in index order. Thresholds are found by bisection on z. step += 1, pos += 1 when `advance`
//   (not in the passes of speculative decoding, whose rows share a slot: the host moves it on).
//   block 1024.

// u32 words of one slot's sampling parameters (ops::SampleParams::WORDS).
#define SAMPLE_WORDS 7

#define SAMPLE_BISECT 32

// Logit scans read 16 bytes per load with 4 loads in flight per thread (V % 4 == 0; else one
// float per load): a block of 1024 threads then streams a 248k vocabulary in ~60 loads each
// instead of waiting out ~240 dependent ones.
#define SCAN_UNROLL 4

// f(i, v) for every logit i of logits[0..V] this thread owns, in increasing i.
template <typename F>
__device__ __forceinline__ void scan_logits(const float* logits, int V, F f) {
    if ((V & 3) == 0) {
        const float4* l4 = reinterpret_cast<const float4*>(logits);
        const int n4 = V >> 2, step = blockDim.x;
        for (int i = threadIdx.x; i < n4; i += SCAN_UNROLL * step) {
            float4 q[SCAN_UNROLL];
#pragma unroll
            for (int u = 0; u < SCAN_UNROLL; ++u) {
                int j = i + u * step;
                q[u] = j < n4 ? l4[j] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < SCAN_UNROLL; ++u) {
                int j = i + u * step;
                if (j < n4) {
                    f(4 * j, q[u].x);
                    f(4 * j + 1, q[u].y);
                    f(4 * j + 2, q[u].z);
                    f(4 * j + 3, q[u].w);
                }
            }
        }
    } else {
        for (int i = threadIdx.x; i < V; i += blockDim.x) f(i, logits[i]);
    }
}

// Σ over kept tokens (z ≥ t) of e^z, or their count when `count`.
__device__ float kept_sum(const float* logits, int V, float m, float inv_t, float t, bool count) {
    float acc = 0.f;
    scan_logits(logits, V, [&](int, float l) {
        float z = (l - m) * inv_t;
        if (z >= t) acc += count ? 1.f : expf(z);
    });
    return block_sum(acc);
}

__device__ __forceinline__ float uniform_u01(unsigned long long seed, unsigned long long i) {
    unsigned long long z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

extern "C" __global__ void sample_advance(const float* logits, int V, unsigned int* __restrict__ params,
                                          int* __restrict__ tok, int* __restrict__ pos,
                                          const int* __restrict__ slots, const float* pairs, int npairs,
                                          int advance) {
    pdl_entry();
    __shared__ float scan[32];
    __shared__ int found;
    int t = threadIdx.x;
    int row = blockIdx.x, slot = slots[row];
    logits += (long long)row * V;
    params += (long long)SAMPLE_WORDS * slot;
    tok += row;
    pos += slot;
    float temp = __uint_as_float(params[0]);
    // Max and its (lowest) index: from the lm_head's pair a block when it wrote them (one row),
    // else by a scan of the logits.
    float bv = NEG_INF;
    int bi = V;
    if (npairs > 0) {
        for (int b = t; b < npairs; b += blockDim.x) {
            const float v = pairs[2 * b];
            const int i = __float_as_int(pairs[2 * b + 1]);
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
    } else {
        scan_logits(logits, V, [&](int i, float v) {
            if (v > bv) { bv = v; bi = i; }
        });
    }
    block_argmax(bv, bi);
    const float m = bv;
    const int best = bi;
    if (!(temp > 0.f)) {
        if (t == 0) {
            tok[0] = best;
            if (advance) pos[0] += 1;
        }
        return;
    }
    float inv_t = 1.f / temp;
    unsigned int top_k = params[1];
    float top_p = __uint_as_float(params[2]);
    float min_p = __uint_as_float(params[3]);
    unsigned long long seed = (unsigned long long)params[4] | ((unsigned long long)params[5] << 32);
    unsigned int step = params[6];
    // Lowest z present bounds the bisections.
    float zmin = 0.f;
    scan_logits(logits, V, [&](int, float l) { zmin = fminf(zmin, (l - m) * inv_t); });
    zmin = -block_max(-zmin);
    float thr = zmin;
    if (top_k > 0 && top_k < (unsigned int)V) {
        // Largest threshold keeping at least top_k tokens.
        float lo = zmin, hi = 0.f;
        for (int it = 0; it < SAMPLE_BISECT; ++it) {
            float mid = 0.5f * (lo + hi);
            if (kept_sum(logits, V, m, inv_t, mid, true) >= (float)top_k) lo = mid; else hi = mid;
        }
        thr = lo;
    }
    if (top_p < 1.f) {
        float total = kept_sum(logits, V, m, inv_t, thr, false);
        float lo = thr, hi = 0.f;
        for (int it = 0; it < SAMPLE_BISECT; ++it) {
            float mid = 0.5f * (lo + hi);
            if (kept_sum(logits, V, m, inv_t, mid, false) >= top_p * total) lo = mid; else hi = mid;
        }
        thr = lo;
    }
    if (min_p > 0.f) thr = fmaxf(thr, logf(min_p));
    // Each thread sums a contiguous run of indices; a block scan finds the run holding u.
    int per = (V + blockDim.x - 1) / blockDim.x;
    int i0 = t * per, i1 = min(V, i0 + per);
    float mine = 0.f;
    for (int i = i0; i < i1; ++i) {
        float z = (logits[i] - m) * inv_t;
        if (z >= thr) mine += expf(z);
    }
    float incl = mine;
    int lane = t & 31, w = t >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
    }
    if (lane == 31) scan[w] = incl;
    if (t == 0) found = -1;
    __syncthreads();
    if (w == 0) {
        float v = lane < ((blockDim.x + 31) >> 5) ? scan[lane] : 0.f;
        for (int o = 1; o < 32; o <<= 1) {
            float n = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += n;
        }
        scan[lane] = v;
    }
    __syncthreads();
    float before = (w > 0 ? scan[w - 1] : 0.f) + incl - mine;
    float total = scan[((blockDim.x + 31) >> 5) - 1];
    float u = uniform_u01(seed, step) * total;
    if (mine > 0.f && u >= before && u < before + mine) {
        float c = before;
        int pick = -1;
        for (int i = i0; i < i1; ++i) {
            float z = (logits[i] - m) * inv_t;
            if (z >= thr) {
                pick = i;
                c += expf(z);
                if (u < c) break;
            }
        }
        found = pick;
    }
    __syncthreads();
    if (t == 0) {
        tok[0] = found >= 0 ? found : best;
        if (advance) {
            params[6] = step + 1;
            pos[0] += 1;
        }
    }
}
