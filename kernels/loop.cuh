// The trainer's fused acting kernel, emitted for every environment by DT_DEFINE_ENV.
#pragma once
#define DT_ENV_LOOP_KERNELS(Env, name)
