// What differs between the platforms the kernels are built for, so that kernels.cu, pick.cu
// and mamba.cu are one source for all of them:
// - CUDA (NVRTC, engine/drivers/cuda/compile.py): 32-lane warps, cuda_fp16/cuda_bf16;
// - HIP on AMD (hiprtc on the device, hipcc in the CI compile check, compile_hip.py): a
//   wavefront of 64 lanes (CDNA: gfx90a, gfx94x) or 32 (RDNA: gfx10xx, gfx11xx), given as
//   -DLANES=N by the build and checked against the target's own size where the compiler says it;
// - a host C++ compiler (tests only: the kernels run on the CPU, one fiber per thread), where
//   the force-included runtime supplies CUDA's names and -DLANES=N the lane count.
// Each defines LANES (the threads of a warp or wavefront: every cross-lane reduction and
// lane-indexed layout is written against it, never a literal), lane_xor (the butterfly
// shuffle), the 16-bit word types f16_word and bf16_word, and to_f / from_f<W> between them
// and float (round to nearest even).

#pragma once

#if defined(__HIP__)

#if !defined(__HIPCC_RTC__)
#include <hip/hip_runtime.h>
#endif
#if !defined(LANES)
#error "the HIP build sets LANES to the target's wavefront size (-DLANES=64 or -DLANES=32)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != LANES
#error "LANES differs from the target's wavefront size"
#endif

__device__ __forceinline__ float lane_xor(float v, int s) { return __shfl_xor(v, s); }

// fp16 is the compiler's own _Float16 (conversions round to nearest even); bf16 is a word
// converted by hand, as reference.py's f32_to_bf16 (NaN aside): no header of either kind is
// needed, so hipcc of any ROCm and hiprtc build the same code.
typedef _Float16 f16_word;
struct bf16_word {
  unsigned short bits;
};
__device__ __forceinline__ float to_f(f16_word v) { return (float)v; }
__device__ __forceinline__ float to_f(bf16_word v) { return __uint_as_float((unsigned)v.bits << 16); }
template <typename W> __device__ __forceinline__ W from_f(float v);
template <> __device__ __forceinline__ f16_word from_f<f16_word>(float v) { return (f16_word)v; }
template <> __device__ __forceinline__ bf16_word from_f<bf16_word>(float v) {
  const unsigned b = __float_as_uint(v);
  return bf16_word{(unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)};
}

#elif defined(__CUDACC__) || defined(KERNELS_ON_HOST)

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define LANES 32
#elif !defined(LANES)
#error "a host build sets LANES (-DLANES=32 or -DLANES=64)"
#endif

__device__ __forceinline__ float lane_xor(float v, int s) { return __shfl_xor_sync(0xffffffffu, v, s); }

typedef __half f16_word;
typedef __nv_bfloat16 bf16_word;
__device__ __forceinline__ float to_f(f16_word v) { return __half2float(v); }
__device__ __forceinline__ float to_f(bf16_word v) { return __bfloat162float(v); }
template <typename W> __device__ __forceinline__ W from_f(float v);
template <> __device__ __forceinline__ f16_word from_f<f16_word>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ bf16_word from_f<bf16_word>(float v) { return __float2bfloat16_rn(v); }

#else
#error "no platform: build with NVRTC (CUDA), hipcc or hiprtc (HIP)"
#endif
