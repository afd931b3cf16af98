// Optimizer kernels over flat parameter buffers (docs/step-spec.md, steps 6, 7 and 11).
//
// grad_norm_clip: norm = sqrt(sum g^2) over the whole flat gradient buffer,
//   scale = min(1, max_norm / (norm + 1e-6)), step t += 1, all on the device:
//   clip[0] = norm, clip[1] = scale, *step = t. Then it writes the step's metrics
//   into slot t mod K of a ring in mapped host memory: {loss, norm, scale, t},
//   with t stored last, after a system-wide fence, so a slot whose t matches
//   is complete. With `skip` non-null it is the step's NaN guard: *skip = 1
//   when the norm or *loss is not finite, else 0; a skipped step leaves t
//   (and so the metrics ring) as it was. With `gate` non-null and non-zero (a
//   training loop's step that is not due) it only sets *skip = 2, so the
//   kernels after it skip without reporting anything.
//   Launch: grid = G > 1 (fixed by the caller), block 256. Per-thread sums in a
//   fixed grid-stride order, fixed block trees, and the last block sums the G
//   partials in order: bitwise reproducible for a fixed G, no float atomics.
//
// adamw_step: PyTorch AdamW on every element, with g = grad * clip[1] and the
//   step t read from device memory, so no host scalar changes between steps:
//     theta *= 1 - lr wd;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//     theta -= (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//   Launch: any grid, block 256; n must be a multiple of 4 (flat buffers are
//   padded to 64 floats). Elementwise, deterministic. With `skip` non-null and
//   *skip set, it changes nothing. t >= 1 always: the Python side refuses an
//   update before the first norm, where 1 - beta^0 = 0 would divide by zero.
#include "common.cuh"

constexpr int NORM_THREADS = 256;
constexpr int ADAM_THREADS = 256;

extern "C" __global__ void __launch_bounds__(NORM_THREADS) grad_norm_clip(
        const float* grads, long long n, double* partials, unsigned int* counter, float max_norm,
        float* clip, int* step, const float* loss, float* ring, int ring_slots, int* skip, const int* gate) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) {  // not due: later kernels see skip = 2 and do nothing either
        if (blockIdx.x == 0 && threadIdx.x == 0 && skip != nullptr) *skip = 2;
        return;
    }
    double acc = 0.0;
    const float4* g4 = reinterpret_cast<const float4*>(grads);
    for (long long i = dt_thread_index(); i < n / 4; i += dt_grid_stride()) {
        const float4 g = g4[i];
        acc += (double)g.x * g.x + (double)g.y * g.y + (double)g.z * g.z + (double)g.w * g.w;
    }
    double total;
    if (!dt_grid_sum_last<NORM_THREADS>(acc, partials, counter, total) || threadIdx.x != 0) return;
    const float norm = (float)sqrt(total);
    const float scale = fminf(1.0f, max_norm / (norm + 1e-6f));
    clip[0] = norm;
    clip[1] = scale;
    if (skip != nullptr) {
        const bool bad = !isfinite(norm) || (loss != nullptr && !isfinite(__ldcg(loss)));
        *skip = bad ? 1 : 0;
        if (bad) return;
    }
    const int t = *step + 1;
    *step = t;
    if (ring != nullptr) {
        float* slot = ring + 4 * (t % ring_slots);
        slot[0] = loss != nullptr ? __ldcg(loss) : 0.0f;
        slot[1] = norm;
        slot[2] = scale;
        __threadfence_system();
        reinterpret_cast<volatile int*>(slot)[3] = t;
    }
}

extern "C" __global__ void __launch_bounds__(ADAM_THREADS) adamw_step(
        float* params, const float* grads, float* m, float* v, long long n, float lr, double beta1,
        double beta2, float eps, float weight_decay, const float* clip, const int* step, const int* skip) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (skip != nullptr && *skip) return;
    const float scale = clip[1];
    const int t = *step;
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
    for (long long i = dt_thread_index(); i < n / 4; i += dt_grid_stride()) {
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
