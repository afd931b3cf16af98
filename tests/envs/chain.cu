// A chain of 8 cells, a test environment for the contract of env.cuh (a
// user's own source: "env.cuh" comes from drvtrain's kernels/ folder).
//
// The agent starts in cell 0. Action 1 moves one cell right, action 0 one
// cell left (in cell 0 it stays). Reaching cell 7 ends the episode
// (terminated) with reward +1; every other step gives -0.01. Episodes are
// truncated after 50 steps. The observation is the one-hot cell (8 floats);
// the state is the cell index as a float.
//
// Optimal return: 7 moves right, so 6 * (-0.01) + 1 = 0.94 undiscounted
// (with discount gamma: -0.01 * (1 - gamma^6) / (1 - gamma) + gamma^6).
// A uniformly random policy reaches cell 7 within 50 steps in about 58% of
// episodes, so a DQN agent finds the reward quickly.
// Deterministic: no randomness is drawn.
#include "env.cuh"

struct Chain {
    static constexpr int LENGTH = 8;
    static constexpr int OBS_DIM = LENGTH;
    static constexpr int N_ACTIONS = 2;
    static constexpr int STATE_DIM = 1;
    static constexpr int MAX_STEPS = 50;

    __device__ static void reset(float* state, DtRandom&) { state[0] = 0.0f; }

    __device__ static void observe(const float* state, float* obs) {
        const int cell = (int)state[0];
#pragma unroll
        for (int k = 0; k < OBS_DIM; ++k) obs[k] = k == cell ? 1.0f : 0.0f;
    }

    __device__ static void step(float* state, int action, DtRandom&, float& reward, bool& terminated) {
        int cell = (int)state[0];
        cell = action == 1 ? cell + 1 : (cell > 0 ? cell - 1 : 0);
        state[0] = (float)cell;
        terminated = cell == LENGTH - 1;
        reward = terminated ? 1.0f : -0.01f;
    }
};

DT_DEFINE_ENV(Chain, chain)
