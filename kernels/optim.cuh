// The bodies of optim.cu's kernels, shared with the cooperative tail of
// dqn_step.cu, which runs them as phases of one launch (the maths: optim.cu's
// header). Sharing the code is what makes the two paths agree bit for bit.
#pragma once

// One thread's share of sum g^2 (in double) over float4 elements first,
// first + stride, ... below n / 4, in that order.
__device__ __forceinline__ double dt_sum_of_squares(long long first, long long stride, const float* grads,
                                                    long long n) {
    double acc = 0.0;
    const float4* g4 = reinterpret_cast<const float4*>(grads);
    for (long long i = first; i < n / 4; i += stride) {
        const float4 g = g4[i];
        acc += (double)g.x * g.x + (double)g.y * g.y + (double)g.z * g.z + (double)g.w * g.w;
    }
    return acc;
}

// What the total of the squares decides: the norm, the clip scale, and (with the
// NaN guard) whether the step is skipped: the norm or *loss is not finite.
struct DtClip {
    float norm, scale;
    bool bad;
};

__device__ __forceinline__ DtClip dt_clip_decide(double total, float max_norm, const float* loss, bool guard) {
    DtClip c;
    c.norm = (float)sqrt(total);
    c.scale = fminf(1.0f, max_norm / (c.norm + 1e-6f));
    c.bad = guard && (!isfinite(c.norm) || (loss != nullptr && !isfinite(__ldcg(loss))));
    return c;
}

// One thread writes the decision: clip = {norm, scale}, *skip (when not null),
// and unless the step is skipped, *step = old_step + 1 and the metrics slot
// {loss, norm, scale, t}, with t stored last after a system-wide fence.
__device__ __forceinline__ void dt_clip_publish(const DtClip& c, int old_step, float* clip, int* step,
                                                const float* loss, float* ring, int ring_slots, int* skip) {
    clip[0] = c.norm;
    clip[1] = c.scale;
    if (skip != nullptr) {
        *skip = c.bad ? 1 : 0;
        if (c.bad) return;
    }
    const int t = old_step + 1;
    *step = t;
    if (ring != nullptr) {
        float* slot = ring + 4 * (t % ring_slots);
        slot[0] = loss != nullptr ? __ldcg(loss) : 0.0f;
        slot[1] = c.norm;
        slot[2] = c.scale;
        __threadfence_system();
        reinterpret_cast<volatile int*>(slot)[3] = t;
    }
}

// The AdamW update of float4 elements first, first + stride, ... below n / 4
// (n a multiple of 4), with clip scale `scale` and step `t` (>= 1).
__device__ __forceinline__ void dt_adamw_elements(long long first, long long stride, float* params,
                                                  const float* grads, float* m, float* v, long long n, float lr,
                                                  double beta1, double beta2, float eps, float weight_decay,
                                                  float scale, int t) {
    // The betas arrive in double, so 1 - beta and the bias corrections are
    // rounded once, from the exact values (float32(0.999) would put 1.3e-5
    // relative error into 1 - beta2).
    const float step_size = (float)(lr / (1.0 - pow(beta1, (double)t)));
    const float bias2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)t));
    const float b1 = (float)beta1, b2 = (float)beta2;
    const float c1 = (float)(1.0 - beta1), c2 = (float)(1.0 - beta2);
    const float decay = 1.0f - lr * weight_decay;
    float4* p4 = reinterpret_cast<float4*>(params);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    const float4* g4 = reinterpret_cast<const float4*>(grads);
    for (long long i = first; i < n / 4; i += stride) {
        float4 p = p4[i], mm = m4[i], vv = v4[i];
        const float4 g = g4[i];
        float* pp = &p.x;
        float* mp = &mm.x;
        float* vp = &vv.x;
        const float* gp = &g.x;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float ge = gp[e] * scale;
            pp[e] *= decay;
            mp[e] = b1 * mp[e] + c1 * ge;
            vp[e] = b2 * vp[e] + c2 * ge * ge;
            pp[e] -= step_size * mp[e] / (sqrtf(vp[e]) / bias2_sqrt + eps);
        }
        p4[i] = p;
        m4[i] = mm;
        v4[i] = vv;
    }
}
