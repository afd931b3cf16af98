// TF32 operands for the tensor cores, shared by gemm.cu and gemm_sm90a.cu.
#pragma once

// The tensor cores ignore the low 13 bits of a TF32 operand, so adding half their
// unit first rounds to nearest, ties away from zero: the bits of cvt.rna.tf32.f32
// for every finite x, in one integer add instead of the four instructions sm_90
// spends on cvt.rna. With THREE (3xTF32): x = big + small, big = tf32(x),
// small = tf32(x - big), x - big exact in FP32.
// Infinities and NaNs (exponent all ones) pass unrounded, with small = 0: the add
// would carry a NaN such as 0x7fffffff out of its exponent into -0, and a NaN
// must reach the output so that the step's NaN guard sees it. A finite x within
// half a TF32 unit of FLT_MAX (|x| >= 0x7f7ff000) rounds to infinity, and its
// 3xTF32 terms then sum to NaN: far outside what a layer of the nets holds.
template <bool THREE>
__device__ __forceinline__ void dt_tf32_split(float x, unsigned int& big, unsigned int& small) {
    const unsigned int u = __float_as_uint(x);
    const bool finite = (u & 0x7f800000u) != 0x7f800000u;
    big = finite ? u + 0x1000u : u;
    if (THREE) small = finite ? __float_as_uint(x - __uint_as_float(big & 0xffffe000u)) + 0x1000u : 0u;
}
