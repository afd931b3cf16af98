// TF32 operands for the tensor cores, shared by gemm.cu and gemm_sm90a.cu, and the
// mma.sync product of gemm.cu and narrow.cu.
#pragma once

// The tensor cores ignore the low 13 bits of a TF32 operand, so adding half their
// unit first rounds to nearest, ties away from zero: the bits of cvt.rna.tf32.f32
// for every finite x, in one integer add instead of the four instructions sm_90
// spends on cvt.rna.
// TF32 alone (THREE false): infinities and NaNs (exponent all ones) pass unrounded.
// The add would carry a NaN such as 0x7fffffff out of its exponent into -0, and a
// NaN must reach the output so that the step's NaN guard sees it.
// 3xTF32 (THREE): x = big + small with big = tf32(x) and small = x - big (exact in
// FP32), left for the tensor cores to truncate to TF32, and no test for non-finite
// x: three instructions a value where rounding small and passing non-finite values
// whole took eight (docs/perf-notes.md, twenty-eighth pass). |x - big - small| as
// the tensor cores read them stays within 2^-23 |x|, as it does with small rounded
// (x - big has at most 12 significant bits and TF32 keeps 11: truncating moves the
// last one, rounding the error's sign, not its size), wherever small is a normal
// float (|x| above about 2^-113); tinier values lose more, as any TF32 split's
// subnormal part does. A NaN's NaN still reaches the output, through small: x - big
// is NaN whatever the add did to big's bits (a NaN whose add carries into the sign
// reads as a zero big). An infinite x reads as an infinite big with a NaN small, so
// its products are NaN, not infinite.
// A finite x within half a TF32 unit of FLT_MAX (|x| >= 0x7f7ff000) rounds to
// infinity, and its terms then sum to NaN: far outside what a layer of the nets holds.
template <bool THREE>
__device__ __forceinline__ void dt_tf32_split(float x, unsigned int& big, unsigned int& small) {
    const unsigned int u = __float_as_uint(x);
    if (THREE) {
        big = u + 0x1000u;
        small = __float_as_uint(x - __uint_as_float(big & 0xffffe000u));
    } else {
        big = (u & 0x7f800000u) != 0x7f800000u ? u + 0x1000u : u;
    }
}

// D += A B, one m16n8k8 TF32 product (mma.sync) with FP32 accumulators in place.
__device__ __forceinline__ void dt_mma_tf32(float (&d)[4], const unsigned int (&a)[4], unsigned int b0,
                                            unsigned int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
