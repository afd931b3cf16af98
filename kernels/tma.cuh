// Tensor memory accelerator (TMA) copies for compute capability 9.0 (drvtrain.tma
// encodes the maps on the host; docs there).
//
// A kernel takes a map by value, as `const __grid_constant__ DtTensorMap map` (the
// argument kind `tmap`): the copy reads the map from the kernel's parameter space, so it
// must not be copied into a local variable.
//
// dt_tma_load_2d(dst, &map, x, y, bar): one thread copies the map's box whose top-left
// element is column x, row y of the matrix into shared memory at `dst` (a shared::cta
// address, aligned to 128 bytes; to 256, 512 or 1024 with the 32, 64 or 128-byte
// swizzle, whose pattern repeats that often), completing on the mbarrier `bar` of this block
// (common.cuh: the owner arrives once with the phase's bytes, dt_mbar_arrive_expect,
// and every thread that reads the box waits, dt_mbar_wait). Elements outside the
// matrix arrive as the map's fill. x and y may be negative or past the end, but x times
// the element size must be a multiple of 16 bytes: an unaligned first column is an
// illegal instruction (CUDA_ERROR_ILLEGAL_INSTRUCTION), which ends the context.
#pragma once
#include "common.cuh"

struct alignas(64) DtTensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void dt_tma_load_2d(unsigned int dst, const DtTensorMap* map, int x, int y,
                                               unsigned int bar) {
    DT_CLUSTER_ONLY(asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar) : "memory"));
}

// An L2 cache policy under which every line an access touches is evicted first
// (createpolicy), for dt_tma_load_2d_evict_first: a copy of data read for the last time.
__device__ __forceinline__ unsigned long long dt_l2_evict_first_policy() {
    unsigned long long policy = 0;
    DT_CLUSTER_ONLY(asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy)));
    return policy;
}

// dt_tma_load_2d with an L2 cache policy (dt_l2_evict_first_policy): the same copy.
__device__ __forceinline__ void dt_tma_load_2d_evict_first(unsigned int dst, const DtTensorMap* map, int x, int y,
                                                           unsigned int bar, unsigned long long policy) {
    DT_CLUSTER_ONLY(asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar), "l"(policy)
        : "memory"));
}

// Fetches the map into the constant cache ahead of the first copy that names it.
__device__ __forceinline__ void dt_tma_prefetch_map(const DtTensorMap* map) {
    DT_CLUSTER_ONLY(asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map))
                                 : "memory"));
}
