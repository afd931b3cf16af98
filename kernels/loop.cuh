// The trainer's fused acting kernel, emitted for every environment by DT_DEFINE_ENV.
//
// name_act: one iteration of the acting loop for n envs, one thread per env:
//   1. epsilon-greedy action from the online network's output `q` [n, 1 + A]
//      (dueling: Q = V + A - mean(A); first maximum on ties). epsilon falls
//      linearly from eps_start to eps_end over eps_steps env steps, evaluated
//      from the device's env-step counter; greedy != 0 means epsilon = 0. Two
//      uniforms per env per iteration from the agent's Philox stream.
//   2. the env step, with truncation and auto-reset (env.cuh).
//   3. with a replay given (r_obs non-null): the transition (obs, action,
//      reward, true final obs, done = terminated only, so a truncated episode
//      is bootstrapped) at slot (cursor + i) mod capacity, its leaf set to the
//      largest priority seen so far (the last block recomputes the tree's sums
//      above the n slots, dt_tree_refresh_range).
//   4. a finished episode goes to the ring `episodes` [slots][5] in mapped host
//      memory: {return, length, env step at its end, env index, sequence},
//      the 1-based sequence number stored last, after a system fence, so a row
//      whose sequence matches is complete.
//   5. the last block (dt_last_block): cursor += n, stored = min(stored + n,
//      capacity), env steps += n, iterations += 1; and the schedule: the
//      learning step of this iteration is due when env steps >= learning_starts
//      and a multiple of train_every was crossed; *gate = due ? 0 : 1 (null: no
//      schedule).
// loop: int64 [0] env steps, [1] iterations, [2] episodes finished.
// Launch: one thread per env, block DT_ENV_THREADS (pinned), grid ceil(n / DT_ENV_THREADS).
// Determinism: every write belongs to one env thread, except the episode ring's
// slots, taken in arrival order (atomicAdd on loop[2]); the replay, the
// counters and the learner see the same values in every run.
#pragma once

#include "sumtree.cuh"

template <class Env>
__device__ __forceinline__ int dt_greedy_action(const float (&q_row)[1 + Env::N_ACTIONS]) {
    float mean = 0.0f;
    for (int a = 0; a < Env::N_ACTIONS; ++a) mean += q_row[1 + a];
    mean /= (float)Env::N_ACTIONS;
    int best = 0;
    float best_q = q_row[0] + (q_row[1] - mean);
    for (int a = 1; a < Env::N_ACTIONS; ++a) {
        const float qa = q_row[0] + (q_row[1 + a] - mean);
        if (qa > best_q) {
            best_q = qa;
            best = a;
        }
    }
    return best;
}

template <class Env>
__device__ __forceinline__ void dt_act_step_insert(
        const float* q, float* states, float* obs, int* episode_steps, unsigned int* rng_counters, int n,
        unsigned long long seed, float* ep_return, long long* loop, float eps_start, float eps_end,
        long long eps_steps, int greedy, long long learning_starts, long long train_every, int* gate,
        float* r_obs, float* r_next_obs, int* r_action, float* r_reward, float* r_done, int capacity,
        long long* r_state, double* nodes, float* leaves, const float* max_leaf, int tree_height,
        int tree_internal, unsigned int* counter, double* episodes, int episode_slots) {
    const int i = (int)dt_thread_index();
    const long long env_steps = loop[0];
    if (i < n) {
        // Every load first (the env's copies, its Q row, its observation, its
        // return, the replay's cursor and the largest leaf), so that one round trip
        // serves them all; then the work (in registers, for a small env); then the
        // stores.
        DtEnvRegs<Env> env;
        env.load(states, episode_steps, rng_counters, i);
        float q_row[1 + Env::N_ACTIONS], before[Env::OBS_DIM];
        const float* qi = q + (long long)i * (1 + Env::N_ACTIONS);
#pragma unroll
        for (int a = 0; a < 1 + Env::N_ACTIONS; ++a) q_row[a] = qi[a];
        float* row = obs + (long long)i * Env::OBS_DIM;
#pragma unroll(dt_env_unroll<Env>())
        for (int d = 0; d < Env::OBS_DIM; ++d) before[d] = row[d];
        const float ret_before = ep_return[i];
        const bool insert = r_obs != nullptr;
        const long long cursor = insert ? r_state[0] : 0;
        const float priority = insert ? *max_leaf : 0.0f;

        DtRandom agent{seed, (unsigned int)i, DT_RNG_AGENT, env.counter()};
        const float explore = agent.uniform(), pick = agent.uniform();
        float eps = 0.0f;
        if (!greedy) {
            const float frac = eps_steps > 0 ? fminf(1.0f, (float)env_steps / (float)eps_steps) : 1.0f;
            eps = eps_start + (eps_end - eps_start) * frac;
        }
        int action = dt_greedy_action<Env>(q_row);
        if (explore < eps) action = min(Env::N_ACTIONS - 1, (int)(pick * (float)Env::N_ACTIONS));
        float after[Env::OBS_DIM];
        DtEnvObs<Env> next(row);
        float reward;
        bool terminated, truncated;
        const int length = dt_env_step_one<Env>(env, i, action, seed, after, next.at(), reward, terminated,
                                                truncated);
        const float ret = ret_before + reward;
        const bool finished = terminated || truncated;

        env.store(states, episode_steps, rng_counters, i);
        next.store();
        ep_return[i] = finished ? 0.0f : ret;
        if (finished) {
            const unsigned long long k = atomicAdd(reinterpret_cast<unsigned long long*>(&loop[2]), 1ull);
            double* e = episodes + 5 * (long long)(k % (unsigned long long)episode_slots);
            e[0] = ret;
            e[1] = length;
            e[2] = (double)(env_steps + n);
            e[3] = i;
            __threadfence_system();
            reinterpret_cast<volatile double*>(e)[4] = (double)(k + 1);
        }
        if (insert) {
            const int slot = (int)((cursor + i) % capacity);
            const long long o = (long long)slot * Env::OBS_DIM;
#pragma unroll(dt_env_unroll<Env>())
            for (int d = 0; d < Env::OBS_DIM; ++d) {
                r_obs[o + d] = before[d];
                r_next_obs[o + d] = after[d];
            }
            r_action[slot] = action;
            r_reward[slot] = reward;
            r_done[slot] = terminated ? 1.0f : 0.0f;
            leaves[slot] = priority;
        }
    }
    if (!dt_last_block(counter, gridDim.x)) return;
    // The inserted leaves' ancestors, from the cursor every block read before it arrived.
    if (r_obs != nullptr) dt_tree_refresh_range(nodes, leaves, capacity, tree_height, tree_internal, r_state[0], n);
    if (threadIdx.x != 0) return;
    if (r_obs != nullptr) {
        const long long stored = r_state[1] + n;
        r_state[0] += n;
        r_state[1] = stored < capacity ? stored : capacity;
    }
    const long long after_steps = env_steps + n;
    loop[0] = after_steps;
    loop[1] += 1;
    if (gate != nullptr) {
        const bool crossed = after_steps / train_every > env_steps / train_every;
        *gate = (after_steps >= learning_starts && crossed) ? 0 : 1;
    }
}

#define DT_ENV_LOOP_KERNELS(Env, name)                                                                        \
    extern "C" __global__ void __launch_bounds__(DT_ENV_THREADS) name##_act(                                  \
            const float* q, float* states, float* obs, int* episode_steps, unsigned int* rng_counters, int n,  \
            unsigned long long seed, float* ep_return, long long* loop, float eps_start, float eps_end,         \
            long long eps_steps, int greedy, long long learning_starts, long long train_every, int* gate,      \
            float* r_obs, float* r_next_obs, int* r_action, float* r_reward, float* r_done, int capacity,      \
            long long* r_state, double* nodes, float* leaves, const float* max_leaf, int tree_height,          \
            int tree_internal, unsigned int* counter, double* episodes, int episode_slots) {                   \
        dt_wait_prior_grid();                                                                                  \
        dt_allow_dependents();                                                                                 \
        dt_act_step_insert<Env>(q, states, obs, episode_steps, rng_counters, n, seed, ep_return, loop,         \
                                eps_start, eps_end, eps_steps, greedy, learning_starts, train_every, gate,     \
                                r_obs, r_next_obs, r_action, r_reward, r_done, capacity, r_state, nodes,        \
                                leaves, max_leaf, tree_height, tree_internal, counter, episodes,              \
                                episode_slots);                                                                 \
    }
