// The linear layers' fused epilogues, per output element: shared by gemm.cu and
// gemm_sm90a.cu, so every tile and both instruction sets give the same bits.
#pragma once

enum { EPI_NONE = 0, EPI_BIAS = 1, EPI_BIAS_RELU = 2, EPI_MASK = 3 };

// v: the product's element; bias: its column's bias (EPI_BIAS, EPI_BIAS_RELU);
// mask: the saved activation at its place (EPI_MASK). Unused arguments are ignored.
template <int EPI>
__device__ __forceinline__ float dt_epilogue(float v, float bias, float mask) {
    if (EPI == EPI_BIAS || EPI == EPI_BIAS_RELU) v += bias;
    // ReLU that keeps a NaN (fmaxf would return 0); + 0.0f turns -0 into +0, as fmaxf did.
    if (EPI == EPI_BIAS_RELU) v = v < 0.0f ? 0.0f : v + 0.0f;
    // The layer input is relu(z), and relu(z) > 0 exactly when z > 0, so the mask
    // of the saved activation equals the mask of the pre-activation.
    if (EPI == EPI_MASK && !(mask > 0.0f)) v = 0.0f;
    return v;
}

// Whether rows of C, ldc floats apart, take one 8-byte store at each even column.
__device__ __forceinline__ bool dt_pairs_fit(const float* C, int ldc) {
    return (reinterpret_cast<unsigned long long>(C) & 7ull) == 0 && (ldc & 1) == 0;
}

// A fragment's two neighbouring outputs v0, v1 at out[0], out[1], columns c (even) and
// c + 1 of N: one 8-byte store where `pairs` (dt_pairs_fit) and both are inside C, else
// each one inside it alone.
__device__ __forceinline__ void dt_store_pair(float* out, float v0, float v1, int c, int N, bool pairs) {
    if (pairs && c + 1 < N) {
        *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
    } else {
        if (c < N) out[0] = v0;
        if (c + 1 < N) out[1] = v1;
    }
}
