// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator. The same
// (counter, key) always gives the same four words, so a graph replay that
// reads a fresh counter from device memory draws fresh numbers, and a seed
// reproduces the stream.
#pragma once

struct dt_u32x4 { unsigned int x, y, z, w; };

__device__ __forceinline__ dt_u32x4 dt_philox4x32_10(dt_u32x4 c, unsigned int k0, unsigned int k1) {
    const unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    const unsigned int W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        unsigned int hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        unsigned int hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = dt_u32x4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
        k0 += W0;
        k1 += W1;
    }
    return c;
}

// A double in [0, 1) with 53 random bits, for stream position (index, step).
__device__ __forceinline__ double dt_uniform53(unsigned long long seed, unsigned long long step,
                                               unsigned int index) {
    dt_u32x4 r = dt_philox4x32_10(
        dt_u32x4{index, (unsigned int)step, (unsigned int)(step >> 32), 0u},
        (unsigned int)seed, (unsigned int)(seed >> 32));
    unsigned long long bits = ((unsigned long long)(r.x >> 5) << 26) | (r.y >> 6);
    return (double)bits * (1.0 / 9007199254740992.0);  // 2^-53
}
