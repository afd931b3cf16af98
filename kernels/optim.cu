// Optimizer kernels over flat parameter buffers (docs/step-spec.md, steps 6, 7 and 11).
//
// grad_norm_clip: norm = sqrt(sum g^2) over the whole flat gradient buffer,
//   scale = min(1, max_norm / (norm + 1e-6)), step t += 1, all on the device:
//   clip[0] = norm, clip[1] = scale, *step = t. Then it writes the step's metrics
//   into slot t mod K of a ring in mapped host memory: {loss, norm, scale},
//   each field an 8-byte word tagged with t (dt_metric_store), so a slot
//   whose every tag is t is complete. With `skip` non-null it is the step's
//   NaN guard: *skip = 1 when the norm or *loss is not finite, else 0; a skipped step leaves t
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
//
// grad_norm_partials + adamw_clip_step: the same two steps with no last block
//   (AdamW.step() launches them). grad_norm_partials writes its blocks' partial
//   sums of g^2 to partials[0 .. G) exactly as grad_norm_clip's blocks do, and
//   block 0 writes *t_next = *step + 1; it decides nothing.
//   grad_norm_partials_first_dw first sums dW0 and db0 (at float offsets dw0
//   and db0 of `grads`) from the tile shares that gemm.cu's grad_input_dw0
//   kernels left with no strip counters (optim.cuh's DtFirstDw: in0, cols,
//   rows, bn), in that kernel's order, and stores them into `grads`: the same
//   gradients, norm and update as if that kernel had summed them itself.
//   Every block of adamw_clip_step then adds the G partials in grad_norm_clip's last-block
//   order (the same bits in every block), takes the norm, the clip scale and
//   the NaN guard's decision from them as grad_norm_clip does, and updates its
//   elements with t = *t_next; block 0 publishes clip, skip, *step = t and the
//   metrics slot as grad_norm_clip's last block does. No block of either
//   kernel depends on what another block of it writes (adamw_clip_step takes t
//   from t_next, not from the *step its block 0 advances; it reads *step only
//   for a guess at t, which it checks against t_next). With `gate` non-null and
//   non-zero, grad_norm_partials returns at once and adamw_clip_step only sets
//   *skip = 2. Launch: grad_norm_partials as grad_norm_clip (grid G, block
//   256); adamw_clip_step any grid, block 256, with G = norm_blocks.
#include "common.cuh"
#include "optim.cuh"

constexpr int NORM_THREADS = 256;

extern "C" __global__ void __launch_bounds__(NORM_THREADS) grad_norm_clip(
        const float* grads, long long n, double* partials, unsigned int* counter, float max_norm,
        float* clip, int* step, const float* loss, unsigned long long* ring, int ring_slots, int* skip,
        const int* gate) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) {  // not due: later kernels see skip = 2 and do nothing either
        if (blockIdx.x == 0 && threadIdx.x == 0 && skip != nullptr) *skip = 2;
        return;
    }
    const double acc = dt_sum_of_squares(dt_thread_index(), dt_grid_stride(), grads, n);
    double total;
    if (!dt_grid_sum_last<NORM_THREADS>(acc, partials, counter, total) || threadIdx.x != 0) return;
    const DtClip c = dt_clip_decide(total, max_norm, loss, skip != nullptr);
    dt_clip_publish(c, *step, clip, step, loss, ring, ring_slots, skip);
}

extern "C" __global__ void __launch_bounds__(ADAM_THREADS) adamw_step(
        float* params, const float* grads, float* m, float* v, long long n, float lr, double beta1,
        double beta2, float eps, float weight_decay, const float* clip, const int* step, const int* skip) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    // The first float4's operands, the flag, the scale and t are independent
    // loads: all are in flight before any is used (reading params on a skipped
    // step is harmless), and the bias corrections' pow calls run under them.
    const long long first = dt_thread_index(), stride = dt_grid_stride();
    DtAdamWFloat4 x;
    if (first < n / 4) x = dt_adamw_load(first, params, grads, m, v);
    const int skipped = skip != nullptr ? *skip : 0;
    const float scale = clip[1];
    const int t = *step;
    dt_issued(skipped);
    dt_issued(scale);
    dt_issued(t);
    if (skipped) return;
    const DtAdamW a = dt_adamw_setup(lr, beta1, beta2, eps, weight_decay, scale, t);
    if (first < n / 4) dt_adamw_store(a, x, first, params, m, v);
    dt_adamw_elements(a, first + stride, stride, params, grads, m, v, n);
}

// FIRST_DW: grad_norm_partials_first_dw, which sums dW0 and db0 first.
template <bool FIRST_DW>
__device__ __forceinline__ void norm_partials(float* grads, long long n, double* partials, const int* step,
                                              int* t_next, const int* gate, const DtFirstDw& first_dw) {
    dt_wait_prior_grid();
    dt_allow_dependents();
    if (gate != nullptr && *gate) return;
    const long long first = dt_thread_index(), stride = dt_grid_stride();
    const double block = dt_block_sum<NORM_THREADS>(
        FIRST_DW ? dt_sum_of_squares_first_dw(first, stride, grads, n, first_dw)
                 : dt_sum_of_squares(first, stride, grads, n));
    if (threadIdx.x != 0) return;
    partials[blockIdx.x] = block;
    if (blockIdx.x == 0) *t_next = *step + 1;
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) grad_norm_partials(
        const float* grads, long long n, double* partials, const int* step, int* t_next, const int* gate) {
    norm_partials<false>(const_cast<float*>(grads), n, partials, step, t_next, gate, DtFirstDw{});
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS) grad_norm_partials_first_dw(
        float* grads, long long n, double* partials, const int* step, int* t_next, const int* gate,
        const float* shares, long long dw0, long long db0, int in0, int cols, int rows, int bn) {
    norm_partials<true>(grads, n, partials, step, t_next, gate, DtFirstDw{shares, dw0, db0, in0, cols, rows, bn});
}

static_assert(ADAM_THREADS == NORM_THREADS, "every AdamW block adds the partials in the norm's last-block order");

extern "C" __global__ void __launch_bounds__(ADAM_THREADS) adamw_clip_step(
        float* params, const float* grads, float* m, float* v, long long n, float lr, double beta1, double beta2,
        float eps, float weight_decay, const double* partials, int norm_blocks, float max_norm, const float* loss,
        const int* t_next, float* clip, int* step, unsigned long long* ring, int ring_slots, int* skip,
        const int* gate) {
    // The bias corrections need only t, and t is the step counter plus one: a guess
    // read through L2 before the wait lets their pow calls run under the norm
    // kernel's tail. The guess is checked against t_next below and redone if wrong,
    // so nothing depends on it but the time (a block that starts after block 0 has
    // advanced the counter guesses one too many).
    const int t_guess = __ldcg(step) + 1;
    DtAdamW a = dt_adamw_setup(lr, beta1, beta2, eps, weight_decay, 1.0f, t_guess);
    dt_issued(a.step_scaled);  // computed here, not sunk past the wait
    dt_issued(a.eps_scaled);
    // The first float4 of params, m and v before the wait too: the kernel before this
    // one is always grad_norm_partials (AdamW.step launches both), which writes none
    // of them, and whatever wrote them last (this kernel, the finish pass, the host, a
    // caller's kernel) ended before that kernel's own wait returned, which it passes
    // before it lets this one start (common.cuh). grads is read after the wait:
    // grad_norm_partials_first_dw writes dW0 and db0 into it.
    const long long first = dt_thread_index(), stride = dt_grid_stride();
    DtAdamWFloat4 x;
    if (first < n / 4) {
        x.p = reinterpret_cast<const float4*>(params)[first];
        x.m = dt_load_evict_first(m, first);
        x.v = dt_load_evict_first(v, first);
    }
    dt_wait_prior_grid();
    dt_allow_dependents();
    // One round of loads: the first float4's gradient, this thread's first two
    // partials (every one while there are at most 512), the loss, the gate and t.
    if (first < n / 4) x.g = dt_load_evict_first(grads, first);
    const int second = threadIdx.x + ADAM_THREADS;
    const double head = (int)threadIdx.x < norm_blocks ? __ldcg(&partials[threadIdx.x]) : 0.0;
    const double next = second < norm_blocks ? __ldcg(&partials[second]) : 0.0;
    const float loss_value = loss != nullptr ? __ldcg(loss) : 0.0f;
    const int gated = dt_read_flag(gate);
    const int t = __ldcg(t_next);
    dt_issued(head);
    dt_issued(next);
    dt_issued(loss_value);
    dt_issued(gated);
    dt_issued(t);
    if (gated) {  // not due: later kernels see skip = 2 and do nothing either
        if (blockIdx.x == 0 && threadIdx.x == 0 && skip != nullptr) *skip = 2;
        return;
    }
    if (t != t_guess) a = dt_adamw_setup(lr, beta1, beta2, eps, weight_decay, 1.0f, t);
    const double loaded[2] = {head, next};  // dt_partials_sum's order, its first two partials loaded above
    const double share = dt_partials_share<ADAM_THREADS, 2>(partials, norm_blocks, loaded);
    const DtClip c = dt_clip_decide_value(dt_block_sum<ADAM_THREADS>(share), max_norm, loss != nullptr, loss_value,
                                          skip != nullptr);
    if (blockIdx.x == 0 && threadIdx.x == 0) dt_clip_publish(c, t - 1, clip, step, loss, ring, ring_slots, skip);
    if (c.bad) return;
    a.scale = c.scale;
    if (first < n / 4) dt_adamw_store(a, x, first, params, m, v);
    dt_adamw_elements(a, first + stride, stride, params, grads, m, v, n);
}
