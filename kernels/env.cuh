// The contract of a device environment, and the kernels every environment gets.
//
// An environment is a struct with:
//   static constexpr int OBS_DIM;     // floats in an observation
//   static constexpr int N_ACTIONS;   // discrete actions 0 .. N_ACTIONS-1
//   static constexpr int STATE_DIM;   // floats of state per env (the observation may be all or part of it)
//   static constexpr int MAX_STEPS;   // steps after which an episode is truncated (0: never)
//   __device__ static void reset(float* state, DtRandom& rng);
//   __device__ static void observe(const float* state, float* obs);
//   __device__ static void step(float* state, int action, DtRandom& rng, float& reward, bool& terminated);
// `state` points at this env's STATE_DIM floats; all randomness comes from `rng`.
// `step` is never called on a finished episode: the kernels below reset it first.
// The kernels below hand these functions a copy of the state in registers
// (DtEnvRegs), loaded before and stored after: the functions must index the
// state with constants once unrolled (as loops with #pragma unroll over
// STATE_DIM do), or the copy spills to local memory.
//
// DT_DEFINE_ENV(Env, name), placed after the struct in a .cu file, emits the
// kernels the Python side (drvtrain.rl.env.DeviceEnv) loads by name:
//   name_reset(states, obs, episode_steps, rng_counters, n, seed)
//   name_step(states, obs, episode_steps, rng_counters, actions, n, seed,
//             final_obs, reward, terminated, truncated)
// and, from loop.cuh, the trainer's fused act-step-insert kernel.
// Randomness: env i draws from Philox keyed by `seed`, at counters
// (i, rng_counters[i]++, stream); the counters live on the device, so a graph
// replay draws fresh numbers and a checkpoint of them resumes the same stream.
// Launch: one thread per env, block DT_ENV_THREADS, grid ceil(n / DT_ENV_THREADS).
#pragma once

#include "common.cuh"
#include "philox.cuh"

constexpr int DT_ENV_THREADS = 128;

// Random streams of one env: the environment's own, and the agent's (exploration).
enum { DT_RNG_ENV = 0, DT_RNG_AGENT = 1 };

struct DtRandom {
    unsigned long long seed;
    unsigned int env;
    unsigned int stream;
    unsigned int* counter;  // this env's draw counter, in device memory

    // A float in [0, 1) with 24 random bits.
    __device__ __forceinline__ float uniform() {
        const unsigned int c = (*counter)++;
        const dt_u32x4 r = dt_philox4x32_10(dt_u32x4{c, env, stream, 0x454e5631u},
                                            (unsigned int)seed, (unsigned int)(seed >> 32));
        return (float)(r.x >> 8) * (1.0f / 16777216.0f);
    }

    __device__ __forceinline__ float uniform(float low, float high) { return low + (high - low) * uniform(); }
};

// One env's state, Philox counter and episode step count, held in registers
// while a kernel works on them: load() issues every load at once, store()
// writes them back. In between, Env's functions and DtRandom touch registers
// only, so no load has to wait for a store it might alias.
template <class Env>
struct DtEnvRegs {
    float state[Env::STATE_DIM];
    unsigned int counter;
    int steps;

    __device__ __forceinline__ void load(const float* states, const int* episode_steps,
                                         const unsigned int* rng_counters, int i) {
        const float* s = states + (long long)i * Env::STATE_DIM;
#pragma unroll
        for (int k = 0; k < Env::STATE_DIM; ++k) state[k] = s[k];
        counter = rng_counters[i];
        steps = episode_steps[i];
    }

    __device__ __forceinline__ void store(float* states, int* episode_steps, unsigned int* rng_counters,
                                          int i) const {
        float* s = states + (long long)i * Env::STATE_DIM;
#pragma unroll
        for (int k = 0; k < Env::STATE_DIM; ++k) s[k] = state[k];
        rng_counters[i] = counter;
        episode_steps[i] = steps;
    }
};

// Stores an observation held in registers to `dst` (global memory).
template <class Env>
__device__ __forceinline__ void dt_env_store_obs(float* dst, const float (&obs)[Env::OBS_DIM]) {
#pragma unroll
    for (int d = 0; d < Env::OBS_DIM; ++d) dst[d] = obs[d];
}

// One step of env i (its registers `env`) with `action`, with truncation and
// auto-reset. On return `final_obs` holds the observation the step reached
// (the true last one of a finished episode), `obs` the observation the next
// step starts from (a fresh episode's first after a reset); both are
// registers, for the caller to store. Returns the step count of the episode
// that the step belonged to (so the caller can record finished episodes).
template <class Env>
__device__ __forceinline__ int dt_env_step_one(DtEnvRegs<Env>& env, int i, int action, unsigned long long seed,
                                               float (&final_obs)[Env::OBS_DIM], float (&obs)[Env::OBS_DIM],
                                               float& reward, bool& terminated, bool& truncated) {
    DtRandom rng{seed, (unsigned int)i, DT_RNG_ENV, &env.counter};
    Env::step(env.state, action, rng, reward, terminated);
    const int steps = env.steps + 1;
    truncated = !terminated && Env::MAX_STEPS > 0 && steps >= Env::MAX_STEPS;
    Env::observe(env.state, final_obs);
    if (terminated || truncated) {
        Env::reset(env.state, rng);
        env.steps = 0;
    } else {
        env.steps = steps;
    }
    Env::observe(env.state, obs);
    return steps;
}

#define DT_ENV_RESET_STEP_KERNELS(Env, name)                                                                  \
    extern "C" __global__ void __launch_bounds__(DT_ENV_THREADS) name##_reset(                                \
            float* states, float* obs, int* episode_steps, unsigned int* rng_counters, int n,                  \
            unsigned long long seed) {                                                                         \
        dt_wait_prior_grid();                                                                                  \
        dt_allow_dependents();                                                                                 \
        const int i = (int)dt_thread_index();                                                                  \
        if (i >= n) return;                                                                                    \
        DtEnvRegs<Env> env;                                                                                    \
        env.load(states, episode_steps, rng_counters, i);                                                      \
        DtRandom rng{seed, (unsigned int)i, DT_RNG_ENV, &env.counter};                                         \
        Env::reset(env.state, rng);                                                                            \
        env.steps = 0;                                                                                         \
        float first[Env::OBS_DIM];                                                                             \
        Env::observe(env.state, first);                                                                        \
        env.store(states, episode_steps, rng_counters, i);                                                     \
        dt_env_store_obs<Env>(obs + (long long)i * Env::OBS_DIM, first);                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DT_ENV_THREADS) name##_step(                                 \
            float* states, float* obs, int* episode_steps, unsigned int* rng_counters, const int* actions,     \
            int n, unsigned long long seed, float* final_obs, float* reward, float* terminated,                \
            float* truncated) {                                                                                \
        dt_wait_prior_grid();                                                                                  \
        dt_allow_dependents();                                                                                 \
        const int i = (int)dt_thread_index();                                                                  \
        if (i >= n) return;                                                                                    \
        DtEnvRegs<Env> env;                                                                                    \
        env.load(states, episode_steps, rng_counters, i);                                                      \
        const int action = actions[i];                                                                         \
        float reached[Env::OBS_DIM], next[Env::OBS_DIM];                                                       \
        float r;                                                                                               \
        bool term, trunc;                                                                                      \
        dt_env_step_one<Env>(env, i, action, seed, reached, next, r, term, trunc);                             \
        env.store(states, episode_steps, rng_counters, i);                                                     \
        dt_env_store_obs<Env>(obs + (long long)i * Env::OBS_DIM, next);                                        \
        dt_env_store_obs<Env>(final_obs + (long long)i * Env::OBS_DIM, reached);                               \
        reward[i] = r;                                                                                         \
        terminated[i] = term ? 1.0f : 0.0f;                                                                    \
        truncated[i] = trunc ? 1.0f : 0.0f;                                                                    \
    }

#include "loop.cuh"

#define DT_DEFINE_ENV(Env, name)            \
    DT_ENV_RESET_STEP_KERNELS(Env, name)    \
    DT_ENV_LOOP_KERNELS(Env, name)
