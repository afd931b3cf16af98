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

// One step of env i with `action`, with truncation and auto-reset. On return:
// `final_obs` holds the observation the step reached (the true last one of a
// finished episode), `obs` the observation the next step starts from (a fresh
// episode's first after a reset). Returns the step count of the episode that
// the step belonged to (so the caller can record finished episodes).
template <class Env>
__device__ __forceinline__ int dt_env_step_one(int i, float* states, float* obs, int* episode_steps,
                                               unsigned int* rng_counters, int action, unsigned long long seed,
                                               float* final_obs, float& reward, bool& terminated,
                                               bool& truncated) {
    float* state = states + (long long)i * Env::STATE_DIM;
    DtRandom rng{seed, (unsigned int)i, DT_RNG_ENV, &rng_counters[i]};
    Env::step(state, action, rng, reward, terminated);
    const int steps = episode_steps[i] + 1;
    truncated = !terminated && Env::MAX_STEPS > 0 && steps >= Env::MAX_STEPS;
    Env::observe(state, final_obs);
    if (terminated || truncated) {
        Env::reset(state, rng);
        episode_steps[i] = 0;
    } else {
        episode_steps[i] = steps;
    }
    Env::observe(state, obs + (long long)i * Env::OBS_DIM);
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
        float* state = states + (long long)i * Env::STATE_DIM;                                                 \
        DtRandom rng{seed, (unsigned int)i, DT_RNG_ENV, &rng_counters[i]};                                     \
        Env::reset(state, rng);                                                                                \
        episode_steps[i] = 0;                                                                                  \
        Env::observe(state, obs + (long long)i * Env::OBS_DIM);                                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(DT_ENV_THREADS) name##_step(                                 \
            float* states, float* obs, int* episode_steps, unsigned int* rng_counters, const int* actions,     \
            int n, unsigned long long seed, float* final_obs, float* reward, float* terminated,                \
            float* truncated) {                                                                                \
        dt_wait_prior_grid();                                                                                  \
        dt_allow_dependents();                                                                                 \
        const int i = (int)dt_thread_index();                                                                  \
        if (i >= n) return;                                                                                    \
        float r;                                                                                               \
        bool term, trunc;                                                                                      \
        dt_env_step_one<Env>(i, states, obs, episode_steps, rng_counters, actions[i], seed,                    \
                             final_obs + (long long)i * Env::OBS_DIM, r, term, trunc);                         \
        reward[i] = r;                                                                                         \
        terminated[i] = term ? 1.0f : 0.0f;                                                                    \
        truncated[i] = trunc ? 1.0f : 0.0f;                                                                    \
    }

#include "loop.cuh"

#define DT_DEFINE_ENV(Env, name)            \
    DT_ENV_RESET_STEP_KERNELS(Env, name)    \
    DT_ENV_LOOP_KERNELS(Env, name)
