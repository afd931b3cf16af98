// The per-sample arithmetic of the dueling Double-DQN loss (docs/step-spec.md,
// steps 4 and 5), shared by dqn.cu's dqn_loss and dqn_head and by gemm.cu's
// dqn_loss_dwl kernels (the loss computed in the output layer's backward
// product): the same instructions in every kernel, so the same bits.
#pragma once

#include "common.cuh"

constexpr int DQN_LOSS_THREADS = 32;
constexpr int DQN_MAX_ACTIONS = 64;

namespace {

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

// x != x is the NaN test (no fast-math, so it is not folded away).
__device__ __forceinline__ bool is_nan(float x) { return x != x; }

// mean(A) of one row [V, A_0 .. A_{n-1}], summed in double in index order.
__device__ __forceinline__ float advantage_mean(const float* row, int n_actions) {
    double s = 0.0;
    for (int k = 0; k < n_actions; ++k) s += row[1 + k];
    return (float)(s / n_actions);
}

// Q(., k) = V + (A_k - mean(A)), associated as in docs/step-spec.md's reference.
__device__ __forceinline__ float dueling_q(const float* row, int k, float mean) {
    return row[0] + (row[1 + k] - mean);
}

// One sample's share of the loss, its mean Q and mean |td|.
struct SampleTerms {
    double loss = 0.0, q = 0.0, abs_td = 0.0;
};

// a* = the first argmax of Q_online(s', .) from its row; `poisoned` when any of
// those Q is NaN (td is then NaN).
__device__ __forceinline__ void sample_argmax(const float* row_next, int n_actions, int& best_a, bool& poisoned) {
    best_a = 0;
    const float mean = advantage_mean(row_next, n_actions);
    float best = dueling_q(row_next, 0, mean);
    poisoned = is_nan(best);
    for (int k = 1; k < n_actions; ++k) {
        const float q = dueling_q(row_next, k, mean);
        poisoned |= is_nan(q);
        if (q > best) {
            best = q;
            best_a = k;
        }
    }
}

// The rest of one sample's loss, given its argmax and the advantage means of its
// Q_target(s') and Q_online(s) rows (advantage_mean of each): writes its priority
// and a*, and overwrites `row` (its Q_online(s, .) row) with its gradient row dout.
__device__ __forceinline__ SampleTerms sample_loss_given(const float* row_target, float mean_target, float* row,
                                                         float mean_s, int best_a, bool poisoned, int a, float r,
                                                         float d, float w, int batch, int n_actions, float gamma,
                                                         float huber_delta, float* priority, int* a_star) {
    if (a_star != nullptr) *a_star = best_a;
    const float q_target = dueling_q(row_target, best_a, mean_target);

    const bool valid = a >= 0 && a < n_actions;
    const int ac = a < 0 ? 0 : (a >= n_actions ? n_actions - 1 : a);
    float q_sa = dueling_q(row, ac, mean_s);
    if (!valid) q_sa = quiet_nan();
    const float y = r + gamma * (1.0f - d) * q_target;
    float td = y - q_sa;
    if (poisoned) td = quiet_nan();
    const float abs_td = fabsf(td);
    // Written so that a NaN td takes the branch that keeps it NaN.
    const float huber = abs_td < huber_delta ? 0.5f * td * td : huber_delta * (abs_td - 0.5f * huber_delta);
    const float slope = abs_td >= huber_delta ? copysignf(huber_delta, td) : td;
    const float g = -(w * slope) / (float)batch;
    const float inv_n = 1.0f / (float)n_actions;
    row[0] = g;
    // The one-hot of `a` itself, not of `ac`: for a valid action they are equal, and for
    // an invalid one g is NaN and so is every product. (With n_actions a constant 2, as
    // in dqn_head_a2, ptxas 13.0 tested `k == ac` through the clamp's VIMNMX.RELU and
    // got k = 1 wrong for a = 0; test_head_kernel_matches_float64 found it on the H200.)
    for (int k = 0; k < n_actions; ++k) row[1 + k] = g * ((k == a ? 1.0f : 0.0f) - inv_n);
    *priority = abs_td + 1e-6f;
    SampleTerms terms;
    terms.loss = (double)w * (double)huber;
    terms.q = q_sa;
    terms.abs_td = abs_td;
    return terms;
}

// The loss of one sample from its three Q rows (every loss kernel): writes its
// priority and a*, and overwrites `row` (its Q_online(s, .) row) with its
// gradient row dout. The NaN rules are dqn_loss's.
__device__ __forceinline__ SampleTerms sample_loss(const float* row_next, const float* row_target, float* row,
                                                   int a, float r, float d, float w, int batch, int n_actions,
                                                   float gamma, float huber_delta, float* priority, int* a_star) {
    int best_a;
    bool poisoned;
    sample_argmax(row_next, n_actions, best_a, poisoned);
    const float mean_target = advantage_mean(row_target, n_actions);
    const float mean_s = advantage_mean(row, n_actions);
    return sample_loss_given(row_target, mean_target, row, mean_s, best_a, poisoned, a, r, d, w, batch, n_actions,
                             gamma, huber_delta, priority, a_star);
}

// Copies n floats global -> shared with cp.async, THREADS threads a block: 16
// bytes a copy when `vec` (src and dst on 16-byte boundaries), the last n % 4
// floats 4 bytes each (a 16-byte copy that reads fewer bytes still counts as
// a 16-byte read past the end of the source); all 4 bytes each otherwise.
// Rolled: a copy does not wait, so unrolling would only add code.
template <int THREADS>
__device__ __forceinline__ void stage_floats(float* dst, const float* src, int n, bool vec) {
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(dst);
    const int quads = vec ? n / 4 : 0;
#pragma unroll 1
    for (int e = threadIdx.x; e < quads; e += THREADS) dt_cp_async16(base + 16u * e, src + 4 * e, 16);
#pragma unroll 1
    for (int e = 4 * quads + threadIdx.x; e < n; e += THREADS) dt_cp_async4(base + 4u * e, src + e, 4);
}

}  // namespace
