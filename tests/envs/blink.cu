// A test environment whose every episode is one step long (MAX_STEPS = 1): each
// step of each env ends an episode, by truncation. The reward is the action
// taken (0 or 1); the observation is the state, which counts the env's episodes
// (two floats: the count and 1). Deterministic: no randomness is drawn.
#include "env.cuh"

struct Blink {
    static constexpr int OBS_DIM = 2;
    static constexpr int N_ACTIONS = 2;
    static constexpr int STATE_DIM = 1;
    static constexpr int MAX_STEPS = 1;

    __device__ static void reset(float* state, DtRandom&) { state[0] += 1.0f; }

    __device__ static void observe(const float* state, float* obs) {
        obs[0] = state[0];
        obs[1] = 1.0f;
    }

    __device__ static void step(float*, int action, DtRandom&, float& reward, bool& terminated) {
        reward = action == 1 ? 1.0f : 0.0f;
        terminated = false;
    }
};

DT_DEFINE_ENV(Blink, blink)
