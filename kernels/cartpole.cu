// CartPole-v1 on the device: the contract of env.cuh (one thread per env,
// block DT_ENV_THREADS; reset, observe and step as that header describes).
//
// The dynamics, constants, order of operations, thresholds and rewards are
// Gymnasium's CartPole-v1: a cart of 1.0 kg, a pole of 0.1 kg and half-length
// 0.5 m, a force of 10 N (action 1 pushes right, action 0 left), explicit Euler
// with tau = 0.02 s. The episode terminates when x < -2.4 or x > 2.4 or
// theta < -12 deg or theta > 12 deg (strict, as Gymnasium compares) and is
// truncated after 500 steps; the reward is 1 on every step, the terminating
// one included. A reset draws each of the four state variables from
// U(-0.05, 0.05). The observation is the whole state (x, x_dot, theta, theta_dot).
//
// The one difference from Gymnasium: the arithmetic is float32 (Gymnasium's
// is float64), so a step agrees with Gymnasium's to about 1e-6 and a state
// within about that of a threshold may terminate on one side and not the other.
// As in Gymnasium, any action other than 1 pushes left.
// Deterministic: the only randomness is the reset's, drawn from DtRandom.
#include "env.cuh"

struct CartPole {
    static constexpr int OBS_DIM = 4;
    static constexpr int N_ACTIONS = 2;
    static constexpr int STATE_DIM = 4;
    static constexpr int MAX_STEPS = 500;

    static constexpr float GRAVITY = 9.8f;
    static constexpr float MASSCART = 1.0f;
    static constexpr float MASSPOLE = 0.1f;
    static constexpr float TOTAL_MASS = MASSPOLE + MASSCART;
    static constexpr float LENGTH = 0.5f;  // half the pole's length
    static constexpr float POLEMASS_LENGTH = MASSPOLE * LENGTH;
    static constexpr float FORCE_MAG = 10.0f;
    static constexpr float TAU = 0.02f;
    static constexpr float X_THRESHOLD = 2.4f;
    static constexpr float THETA_THRESHOLD = (float)(12 * 2 * 3.14159265358979323846 / 360);  // 12 degrees

    __device__ static void reset(float* state, DtRandom& rng) {
#pragma unroll
        for (int k = 0; k < STATE_DIM; ++k) state[k] = rng.uniform(-0.05f, 0.05f);
    }

    __device__ static void observe(const float* state, float* obs) {
#pragma unroll
        for (int k = 0; k < OBS_DIM; ++k) obs[k] = state[k];
    }

    __device__ static void step(float* state, int action, DtRandom&, float& reward, bool& terminated) {
        float x = state[0], x_dot = state[1], theta = state[2], theta_dot = state[3];
        const float force = action == 1 ? FORCE_MAG : -FORCE_MAG;
        float sintheta, costheta;
        sincosf(theta, &sintheta, &costheta);
        // Gymnasium's expressions, evaluated in its order.
        const float temp = (force + POLEMASS_LENGTH * (theta_dot * theta_dot) * sintheta) / TOTAL_MASS;
        const float thetaacc = (GRAVITY * sintheta - costheta * temp) /
                               (LENGTH * (4.0f / 3.0f - MASSPOLE * (costheta * costheta) / TOTAL_MASS));
        const float xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS;
        x = x + TAU * x_dot;
        x_dot = x_dot + TAU * xacc;
        theta = theta + TAU * theta_dot;
        theta_dot = theta_dot + TAU * thetaacc;
        state[0] = x;
        state[1] = x_dot;
        state[2] = theta;
        state[3] = theta_dot;
        terminated = x < -X_THRESHOLD || x > X_THRESHOLD || theta < -THETA_THRESHOLD || theta > THETA_THRESHOLD;
        reward = 1.0f;
    }
};

DT_DEFINE_ENV(CartPole, cartpole)
