// A test environment wider than the kernels keep in registers (env.cuh's
// DT_ENV_REGISTER_FLOATS): 72 floats of state and of observation, so its
// functions work on the state in memory.
//
// A reset draws every state variable from U(0, 1). Action 1 adds k + 1 to
// variable k, any other action subtracts it. The episode terminates when
// variable 0 exceeds 3 and is truncated after 4 steps; the reward is variable
// 1 after the step. The observation is twice the state.
#include "env.cuh"

struct Wide {
    static constexpr int OBS_DIM = 72;
    static constexpr int N_ACTIONS = 2;
    static constexpr int STATE_DIM = 72;
    static constexpr int MAX_STEPS = 4;

    __device__ static void reset(float* state, DtRandom& rng) {
        for (int k = 0; k < STATE_DIM; ++k) state[k] = rng.uniform();
    }

    __device__ static void observe(const float* state, float* obs) {
        for (int k = 0; k < OBS_DIM; ++k) obs[k] = 2.0f * state[k];
    }

    __device__ static void step(float* state, int action, DtRandom&, float& reward, bool& terminated) {
        const float sign = action == 1 ? 1.0f : -1.0f;
        for (int k = 0; k < STATE_DIM; ++k) state[k] += sign * (float)(k + 1);
        terminated = state[0] > 3.0f;
        reward = state[1];
    }
};

DT_DEFINE_ENV(Wide, wide)
