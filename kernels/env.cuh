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
// `state` points at this env's STATE_DIM floats, `obs` at OBS_DIM; all randomness
// comes from `rng`. `step` is never called on a finished episode: the kernels
// below reset it first. For an env of at most DT_ENV_REGISTER_FLOATS floats of
// state and of observation, the kernels below hand these functions a copy of the
// state, and observations to fill, in registers (DtEnvRegs, DtEnvObs), loaded
// before and stored after: index them with constants once unrolled (loops over
// STATE_DIM and OBS_DIM with #pragma unroll), or the copies go to local memory,
// and use plain loads and stores on them (no atomics, __ldg or cp.async: they are
// not global memory). A larger env's pointers are into global memory.
//
// DT_DEFINE_ENV(Env, name), placed after the struct in a .cu file, emits the
// kernels the Python side (drvtrain.rl.env.DeviceEnv) loads by name:
//   name_reset(states, obs, episode_steps, rng_counters, n, seed)
//   name_step(states, obs, episode_steps, rng_counters, actions, n, seed,
//             final_obs, reward, terminated, truncated)
//   name_dims, a device array {OBS_DIM, N_ACTIONS, STATE_DIM, MAX_STEPS}
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
    unsigned int* counter;  // this env's draw counter (DtEnvRegs: a register copy for a small env)

    // A float in [0, 1) with 24 random bits.
    __device__ __forceinline__ float uniform() {
        const unsigned int c = (*counter)++;
        const dt_u32x4 r = dt_philox4x32_10(dt_u32x4{c, env, stream, 0x454e5631u},
                                            (unsigned int)seed, (unsigned int)(seed >> 32));
        return (float)(r.x >> 8) * (1.0f / 16777216.0f);
    }

    __device__ __forceinline__ float uniform(float low, float high) { return low + (high - low) * uniform(); }
};

// Up to this many floats of state and of observation, the kernels below keep an
// env in registers; a larger env works on its state in memory, as its
// functions get it either way.
constexpr int DT_ENV_REGISTER_FLOATS = 64;

template <class Env>
__host__ __device__ constexpr bool dt_env_in_registers() {
    return Env::STATE_DIM <= DT_ENV_REGISTER_FLOATS && Env::OBS_DIM <= DT_ENV_REGISTER_FLOATS;
}

// How far a loop over an observation unrolls: fully for a small env (its copies
// then stay in registers), not at all for a larger one.
template <class Env>
__host__ __device__ constexpr int dt_env_unroll() {
    return dt_env_in_registers<Env>() ? Env::OBS_DIM : 1;
}

// One env's state, Philox counter and episode step count while a kernel works on
// them. For a small env (dt_env_in_registers) load() copies them into registers,
// every load issued at once, and store() writes them back: in between, Env's
// functions and DtRandom touch registers only, so no load waits for a store it
// might alias. A larger env's `state` and `counter` point into memory; only the
// step count is copied.
template <class Env>
struct DtEnvRegs {
    static constexpr bool IN_REGISTERS = dt_env_in_registers<Env>();
    float copy[IN_REGISTERS ? Env::STATE_DIM : 1];
    unsigned int counter_copy;
    float* in_memory;             // a larger env's state
    unsigned int* counter_memory;  // and its counter
    int steps;

    // What Env's functions and DtRandom get: the copies, or the env in memory.
    __device__ __forceinline__ float* state() { return IN_REGISTERS ? copy : in_memory; }
    __device__ __forceinline__ unsigned int* counter() { return IN_REGISTERS ? &counter_copy : counter_memory; }

    __device__ __forceinline__ void load(float* states, const int* episode_steps, unsigned int* rng_counters,
                                         int i) {
        float* s = states + (long long)i * Env::STATE_DIM;
        if constexpr (IN_REGISTERS) {
#pragma unroll
            for (int k = 0; k < Env::STATE_DIM; ++k) copy[k] = s[k];
            counter_copy = rng_counters[i];
        } else {
            in_memory = s;
            counter_memory = &rng_counters[i];
        }
        steps = episode_steps[i];
    }

    __device__ __forceinline__ void store(float* states, int* episode_steps, unsigned int* rng_counters,
                                          int i) const {
        if constexpr (IN_REGISTERS) {
            float* s = states + (long long)i * Env::STATE_DIM;
#pragma unroll
            for (int k = 0; k < Env::STATE_DIM; ++k) s[k] = copy[k];
            rng_counters[i] = counter_copy;
        }
        episode_steps[i] = steps;
    }
};

// An observation on its way to `dst` (global memory): for a small env it is
// built in registers (at()) and written by store(); a larger env's goes to
// `dst` directly, and store() has nothing to do.
template <class Env>
struct DtEnvObs {
    static constexpr bool IN_REGISTERS = dt_env_in_registers<Env>();
    float copy[IN_REGISTERS ? Env::OBS_DIM : 1];
    float* dst;

    __device__ __forceinline__ explicit DtEnvObs(float* to) : dst(to) {}
    __device__ __forceinline__ float* at() { return IN_REGISTERS ? copy : dst; }
    __device__ __forceinline__ void store() const {
        if constexpr (IN_REGISTERS) {
#pragma unroll
            for (int d = 0; d < Env::OBS_DIM; ++d) dst[d] = copy[d];
        }
    }
};

// One step of env i (`env`, loaded) with `action`, with truncation and
// auto-reset. On return `final_obs` holds the observation the step reached
// (the true last one of a finished episode), `obs` the observation the next
// step starts from (a fresh episode's first after a reset). Returns the step
// count of the episode that the step belonged to (so the caller can record
// finished episodes).
template <class Env>
__device__ __forceinline__ int dt_env_step_one(DtEnvRegs<Env>& env, int i, int action, unsigned long long seed,
                                               float* final_obs, float* obs, float& reward, bool& terminated,
                                               bool& truncated) {
    DtRandom rng{seed, (unsigned int)i, DT_RNG_ENV, env.counter()};
    Env::step(env.state(), action, rng, reward, terminated);
    const int steps = env.steps + 1;
    truncated = !terminated && Env::MAX_STEPS > 0 && steps >= Env::MAX_STEPS;
    Env::observe(env.state(), final_obs);
    if (terminated || truncated) {
        Env::reset(env.state(), rng);
        env.steps = 0;
    } else {
        env.steps = steps;
    }
    Env::observe(env.state(), obs);
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
        DtRandom rng{seed, (unsigned int)i, DT_RNG_ENV, env.counter()};                                        \
        Env::reset(env.state(), rng);                                                                          \
        env.steps = 0;                                                                                         \
        DtEnvObs<Env> first(obs + (long long)i * Env::OBS_DIM);                                                \
        Env::observe(env.state(), first.at());                                                                 \
        env.store(states, episode_steps, rng_counters, i);                                                     \
        first.store();                                                                                         \
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
        DtEnvObs<Env> reached(final_obs + (long long)i * Env::OBS_DIM), next(obs + (long long)i * Env::OBS_DIM); \
        float r;                                                                                               \
        bool term, trunc;                                                                                      \
        dt_env_step_one<Env>(env, i, action, seed, reached.at(), next.at(), r, term, trunc);                   \
        env.store(states, episode_steps, rng_counters, i);                                                     \
        next.store();                                                                                          \
        reached.store();                                                                                       \
        reward[i] = r;                                                                                         \
        terminated[i] = term ? 1.0f : 0.0f;                                                                    \
        truncated[i] = trunc ? 1.0f : 0.0f;                                                                    \
    }

#include "loop.cuh"

// name_dims: the struct's OBS_DIM, N_ACTIONS, STATE_DIM and MAX_STEPS, which DeviceEnv
// reads to size its buffers (and to refuse dimensions given that differ).
#define DT_DEFINE_ENV(Env, name)                                                                  \
    DT_ENV_RESET_STEP_KERNELS(Env, name)                                                          \
    DT_ENV_LOOP_KERNELS(Env, name)                                                                \
    extern "C" __device__ const int name##_dims[4] = {Env::OBS_DIM, Env::N_ACTIONS, Env::STATE_DIM, \
                                                      Env::MAX_STEPS};
