// The bodies of optim.cu's kernels, shared with the cooperative tail of
// dqn_step.cu, which runs them as phases of one launch (the maths: optim.cu's
// header). Sharing the code is what makes the two paths agree bit for bit.
// The first layer's dW sums (DtFirstDw) are grad_norm_partials_first_dw's only.
#pragma once

// adamw_clip_step's block (optim.cu). Its sum of the norm's partials runs over
// this many shares, an order dqn_step.cu's priority update repeats.
constexpr int ADAM_THREADS = 256;

// sum g^2 of one float4, in double: every sum of squares below adds these.
__device__ __forceinline__ double dt_squares(float4 g) {
    return (double)g.x * g.x + (double)g.y * g.y + (double)g.z * g.z + (double)g.w * g.w;
}

// One thread's share of sum g^2 (in double) over float4 elements first,
// first + stride, ... below n / 4, in that order.
__device__ __forceinline__ double dt_sum_of_squares(long long first, long long stride, const float* grads,
                                                    long long n) {
    double acc = 0.0;
    const float4* g4 = reinterpret_cast<const float4*>(grads);
    for (long long i = first; i < n / 4; i += stride) acc += dt_squares(g4[i]);
    return acc;
}

// The first layer's dW0 [cols, in0] and db0 [cols] of a flat gradient buffer, left
// as per-tile shares by gemm.cu's grad_input_dw0 kernels launched with no strip
// counters: row tile y's share of column c (strip x = c / bn, of `rows` row tiles)
// is shares[((x * rows + y) * bn + c - x * bn) * (in0 + 1) + i], dW0[c][i] for
// i < in0 and db0[c] for i = in0. An element's sum adds the shares in y order,
// from 0, as that kernel's last block of a strip does: the same bits.
// dw0 and db0 are the float offsets of dW0 and db0 in the buffer.
struct DtFirstDw {
    const float* shares;
    long long dw0, db0;
    int in0, cols, rows, bn;
};

// Whether float4 index i of the buffer holds an element of dW0 or db0.
__device__ __forceinline__ bool dt_first_dw_touches(const DtFirstDw& f, long long i) {
    const long long lo = 4 * i, hi = lo + 4;
    return (lo < f.dw0 + (long long)f.cols * f.in0 && hi > f.dw0) || (lo < f.db0 + f.cols && hi > f.db0);
}

// The float4 at index i with its dW0 and db0 elements summed from their shares (the
// others as `held`). dW0 and db0 start on a float4 (flat buffers align every
// tensor to 64 floats), so a float4 that holds any of their elements starts inside
// one of them and runs on in column order; one division finds its first column.
// Few threads run this, two warps a scheduler, so its every instruction is on
// the step's chain: the columns and strips advance by compares, not divisions.
// The four elements' share loads go out together, eight row tiles at a time,
// before any is added: one round trip to L2 per eight row tiles. The shares were
// written by an earlier kernel, so plain loads: ptxas issued __ldcg's strong loads
// a few at a time, interleaved with the adds.
constexpr int DT_FIRST_DW_ROWS_AT_ONCE = 8;

__device__ __forceinline__ float4 dt_first_dw_float4(const DtFirstDw& f, long long i, float4 held) {
    const long long e = 4 * i;
    const bool weights = e >= f.dw0 && e < f.dw0 + (long long)f.cols * f.in0;
    int c, k0, left;  // the first element's column and index in it; elements of the region from e on
    if (weights) {
        const int r = (int)(e - f.dw0);
        c = r / f.in0;
        k0 = r - c * f.in0;
        left = f.cols * f.in0 - r;
    } else {  // db0: dt_first_dw_touches said it is one or the other
        c = (int)(e - f.db0);
        k0 = f.in0;
        left = f.cols - c;
    }
    const int row = f.in0 + 1;
    int x = c / f.bn, cl = c - x * f.bn;
    const float* at[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        at[k] = k < left ? f.shares + ((size_t)x * f.rows * f.bn + cl) * row + k0 : nullptr;
        if (!weights || ++k0 == f.in0) {  // the next column (db0: one element a column)
            if (weights) k0 = 0;
            if (++cl == f.bn) {
                cl = 0;
                ++x;
            }
        }
    }
    const size_t tile = (size_t)f.bn * row;
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int y0 = 0; y0 < f.rows; y0 += DT_FIRST_DW_ROWS_AT_ONCE) {
        float v[4][DT_FIRST_DW_ROWS_AT_ONCE];
#pragma unroll
        for (int y = 0; y < DT_FIRST_DW_ROWS_AT_ONCE; ++y)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                v[k][y] = at[k] != nullptr && y0 + y < f.rows ? at[k][(y0 + y) * tile] : 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int y = 0; y < DT_FIRST_DW_ROWS_AT_ONCE; ++y)
                if (y0 + y < f.rows) sum[k] += v[k][y];
    }
    return make_float4(at[0] != nullptr ? sum[0] : held.x, at[1] != nullptr ? sum[1] : held.y,
                       at[2] != nullptr ? sum[2] : held.z, at[3] != nullptr ? sum[3] : held.w);
}

// dt_sum_of_squares, with dW0's and db0's elements first summed from their shares
// and stored into `grads` (where AdamW reads them): the squares and their order
// are dt_sum_of_squares'.
__device__ __forceinline__ double dt_sum_of_squares_first_dw(long long first, long long stride, float* grads,
                                                             long long n, const DtFirstDw& f) {
    double acc = 0.0;
    float4* g4 = reinterpret_cast<float4*>(grads);
    for (long long i = first; i < n / 4; i += stride) {
        float4 g = g4[i];
        if (dt_first_dw_touches(f, i)) {
            g = dt_first_dw_float4(f, i, g);
            g4[i] = g;
        }
        acc += dt_squares(g);
    }
    return acc;
}

// What the total of the squares decides: the norm, the clip scale, and (with the
// NaN guard) whether the step is skipped: the norm or *loss is not finite.
struct DtClip {
    float norm, scale;
    bool bad;
};

// dt_clip_decide_value takes the loss already loaded (has_loss false: no loss).
__device__ __forceinline__ DtClip dt_clip_decide_value(double total, float max_norm, bool has_loss,
                                                       float loss_value, bool guard) {
    DtClip c;
    c.norm = (float)sqrt(total);
    c.scale = fminf(1.0f, max_norm / (c.norm + 1e-6f));
    c.bad = guard && (!isfinite(c.norm) || (has_loss && !isfinite(loss_value)));
    return c;
}

__device__ __forceinline__ DtClip dt_clip_decide(double total, float max_norm, const float* loss, bool guard) {
    return dt_clip_decide_value(total, max_norm, loss != nullptr, loss != nullptr ? __ldcg(loss) : 0.0f, guard);
}

// One thread writes the decision: clip = {norm, scale}, *skip (when not null),
// and unless the step is skipped, *step = old_step + 1 and the metrics slot
// t mod ring_slots: {loss, norm, scale}, each a word tagged with t
// (dt_metric_store).
__device__ __forceinline__ void dt_clip_publish(const DtClip& c, int old_step, float* clip, int* step,
                                                const float* loss, unsigned long long* ring, int ring_slots,
                                                int* skip) {
    clip[0] = c.norm;
    clip[1] = c.scale;
    if (skip != nullptr) {
        *skip = c.bad ? 1 : 0;
        if (c.bad) return;
    }
    const int t = old_step + 1;
    *step = t;
    if (ring != nullptr) {
        unsigned long long* slot = ring + 3 * (t % ring_slots);
        dt_metric_store(&slot[0], loss != nullptr ? __ldcg(loss) : 0.0f, t);
        dt_metric_store(&slot[1], c.norm, t);
        dt_metric_store(&slot[2], c.scale, t);
    }
}

// AdamW's per-step constants, from the clip scale and step t (>= 1). The
// bias-corrected update lr m_hat / (sqrt(v_hat) + eps), with
// m_hat = m / (1 - b1^t) and v_hat = v / (1 - b2^t), is computed as
//   m step_scaled / (sqrt(v) + eps_scaled),
//   step_scaled = lr sqrt(1 - b2^t) / (1 - b1^t),  eps_scaled = eps sqrt(1 - b2^t)
// (both sides multiplied by sqrt(1 - b2^t)): the same number, with one division
// an element where dividing by sqrt(1 - b2^t) took a second (measured faster,
// docs/perf-notes.md, fortieth pass).
struct DtAdamW {
    float scale, step_scaled, b1, b2, c1, c2, decay, eps_scaled;
};

__device__ __forceinline__ DtAdamW dt_adamw_setup(float lr, double beta1, double beta2, float eps,
                                                  float weight_decay, float scale, int t) {
    // The betas arrive in double, so 1 - beta and the per-step constants are
    // rounded once, from the exact values (float32(0.999) would put 1.3e-5
    // relative error into 1 - beta2).
    DtAdamW a;
    a.scale = scale;
    const double bias2_sqrt = sqrt(1.0 - pow(beta2, (double)t));
    a.step_scaled = (float)((double)lr / (1.0 - pow(beta1, (double)t)) * bias2_sqrt);
    a.eps_scaled = (float)((double)eps * bias2_sqrt);
    a.b1 = (float)beta1;
    a.b2 = (float)beta2;
    a.c1 = (float)(1.0 - beta1);
    a.c2 = (float)(1.0 - beta2);
    a.decay = __fmaf_rn(-lr, weight_decay, 1.0f);  // one rounding, as 1 - lr * wd always compiled to
    return a;
}

// sqrt.approx.f32, without .ftz (subnormal inputs kept); see dt_adamw_one.
__device__ __forceinline__ float dt_sqrt_approx(float x) {
    float r;
    asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// One element's update, every rounding spelled out (the intrinsics are never
// contracted), so whatever the code around it, the compiler cannot fuse it
// differently: m and v each take one fma over the rounded decay product, exactly
// rounded. The square root and the division are the approximate instructions
// (sqrt.approx.f32 and __fdividef's div.approx.f32, each within 2 ulp for these
// operands, subnormals kept; AdamW refuses an eps that would take the divisor
// below 2^-126): the update term lr m_hat / (sqrt(v_hat) + eps), at most about
// lr, carries a few ulp of its own size, an absolute error of a few 2^-24 lr,
// below half an ulp of p wherever |p| is above about ten times lr (1e-3 at
// lr = 1e-4). The correctly rounded forms wrap each in a range check and
// a branch around a slow path (about 170 more machine instructions in
// adamw_clip_step); with them the small DQN step measured 1.5 us slower, the
// large 0.4 (docs/perf-notes.md, fortieth pass). Deterministic either way.
__device__ __forceinline__ void dt_adamw_one(const DtAdamW& a, float& p, float& m, float& v, float g) {
    const float ge = __fmul_rn(g, a.scale);
    m = __fmaf_rn(ge, a.c1, __fmul_rn(m, a.b1));
    v = __fmaf_rn(ge, __fmul_rn(ge, a.c2), __fmul_rn(v, a.b2));
    const float denom = __fadd_rn(dt_sqrt_approx(v), a.eps_scaled);
    p = __fsub_rn(__fmul_rn(p, a.decay), __fdividef(__fmul_rn(m, a.step_scaled), denom));
}

// The gradient, m and v are not read again this step: the gradient not before the next
// backward overwrites it, m and v not before the next step's AdamW, after all else the step
// touches. Their loads and AdamW's stores of m and v are marked evict-first (ld/st.global.cs),
// so that the L2 keeps what the rest of the step reads: the parameters (the spectral
// iteration, the finish pass, the next forward) and the target network (the finish pass).
// A cache hint changes no value.
__device__ __forceinline__ float4 dt_load_evict_first(const float* p, long long i) {
    return __ldcs(reinterpret_cast<const float4*>(p) + i);
}
__device__ __forceinline__ void dt_store_evict_first(float* p, long long i, float4 x) {
    __stcs(reinterpret_cast<float4*>(p) + i, x);
}

// One float4 of each operand at float4 index i.
struct DtAdamWFloat4 {
    float4 p, m, v, g;
};

__device__ __forceinline__ DtAdamWFloat4 dt_adamw_load(long long i, const float* params, const float* grads,
                                                       const float* m, const float* v) {
    DtAdamWFloat4 x;
    x.p = reinterpret_cast<const float4*>(params)[i];
    x.m = dt_load_evict_first(m, i);
    x.v = dt_load_evict_first(v, i);
    x.g = dt_load_evict_first(grads, i);
    return x;
}

// Updates the loaded float4s and stores params, m and v at float4 index i.
__device__ __forceinline__ void dt_adamw_store(const DtAdamW& a, DtAdamWFloat4 x, long long i, float* params,
                                               float* m, float* v) {
    dt_adamw_one(a, x.p.x, x.m.x, x.v.x, x.g.x);
    dt_adamw_one(a, x.p.y, x.m.y, x.v.y, x.g.y);
    dt_adamw_one(a, x.p.z, x.m.z, x.v.z, x.g.z);
    dt_adamw_one(a, x.p.w, x.m.w, x.v.w, x.g.w);
    reinterpret_cast<float4*>(params)[i] = x.p;
    dt_store_evict_first(m, i, x.m);
    dt_store_evict_first(v, i, x.v);
}

// The AdamW update of float4 elements first, first + stride, ... below n / 4
// (n a multiple of 4).
__device__ __forceinline__ void dt_adamw_elements(const DtAdamW& a, long long first, long long stride,
                                                  float* params, const float* grads, float* m, float* v,
                                                  long long n) {
    for (long long i = first; i < n / 4; i += stride)
        dt_adamw_store(a, dt_adamw_load(i, params, grads, m, v), i, params, m, v);
}
