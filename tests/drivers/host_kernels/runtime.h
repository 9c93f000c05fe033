// The kernels of engine/drivers/cuda, run on the CPU as they are written: a host C++ build of
// the same sources (platform.h's host branch) over this runtime, force-included before them.
// Each GPU thread of a block is a fiber (ucontext); the block's fibers run in turn until each
// waits at __syncthreads or at a shuffle, and a wait ends when every live thread it concerns
// (the block, or the thread's warp of LANES lanes) has arrived. A warp whose lanes wait at
// different points, or a block stuck on a barrier a thread never reaches, is reported as a
// deadlock rather than hung. Blocks run one after another, so `__shared__` is a static.
// Test-only: it proves the kernels' lane arithmetic at a chosen LANES, not their speed.

#pragma once

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define KERNELS_ON_HOST 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct float2 {
  float x, y;
};
struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline unsigned __float_as_uint(float v) {
  unsigned u;
  std::memcpy(&u, &v, 4);
  return u;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
using std::max;
using std::min;

typedef _Float16 __half;
inline float __half2float(__half h) { return (float)h; }
inline __half __float2half_rn(float f) { return (__half)f; }
struct __nv_bfloat16 {
  unsigned short bits;
};
inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float((unsigned)v.bits << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  const unsigned b = __float_as_uint(v);
  return __nv_bfloat16{(unsigned short)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)};
}

namespace sim {

enum class Wait { none, warp, block, done };

struct Fiber {
  ucontext_t ctx;
  Wait wait = Wait::none;
  dim3 tid;
  int parity = 0;
};

constexpr size_t STACK_BYTES = 64 * 1024;
inline dim3 thread_idx, block_idx, block_dim, grid_dim;
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::vector<char> stacks;
inline std::vector<float> exchange[2];  // each thread's value at a shuffle, two rounds apart
inline int current = 0;
inline std::function<void()> body;

inline void wait_at(Wait w) {
  fibers[current].wait = w;
  swapcontext(&fibers[current].ctx, &scheduler);
}

inline void trampoline() {
  body();
  wait_at(Wait::done);
}

// The butterfly shuffle: this lane's value is published, and the one of lane ^ s in the same
// warp is read once every live lane of the warp has published its own.
inline float shuffle_xor(float v, int s) {
  const int t = current;
  const int p = fibers[t].parity ^= 1;
  exchange[p][t] = v;
  wait_at(Wait::warp);
  const int base = t - t % LANES;
  return exchange[p][base + ((t % LANES) ^ s)];
}

// Runs one block to the end; 0, or -1 on a deadlock.
inline int run_block(int threads) {
  for (int t = 0; t < threads; ++t) {
    Fiber& f = fibers[t];
    f.wait = Wait::none;
    f.parity = 0;
    f.tid = dim3{(unsigned)t % block_dim.x, (unsigned)t / block_dim.x % block_dim.y,
                 (unsigned)t / (block_dim.x * block_dim.y)};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks.data() + (size_t)t * STACK_BYTES;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, trampoline, 0);
  }
  for (;;) {
    for (int t = 0; t < threads; ++t) {
      if (fibers[t].wait != Wait::none) continue;
      current = t;
      thread_idx = fibers[t].tid;
      swapcontext(&scheduler, &fibers[t].ctx);
    }
    bool released = false, all_done = true, all_block = true;
    for (int w = 0; w < threads; w += LANES) {
      bool live = false, at_shuffle = true;
      for (int t = w; t < std::min(threads, w + LANES); ++t) {
        if (fibers[t].wait == Wait::done) continue;
        live = true;
        at_shuffle = at_shuffle && fibers[t].wait == Wait::warp;
      }
      if (live && at_shuffle) {
        for (int t = w; t < std::min(threads, w + LANES); ++t)
          if (fibers[t].wait == Wait::warp) fibers[t].wait = Wait::none;
        released = true;
      }
    }
    for (int t = 0; t < threads; ++t) {
      all_done = all_done && fibers[t].wait == Wait::done;
      all_block = all_block && (fibers[t].wait == Wait::block || fibers[t].wait == Wait::done);
    }
    if (all_done) return 0;
    if (released) continue;
    if (!all_block) return -1;
    for (int t = 0; t < threads; ++t)
      if (fibers[t].wait == Wait::block) fibers[t].wait = Wait::none;
  }
}

inline int run_grid() {
  const int threads = (int)(block_dim.x * block_dim.y * block_dim.z);
  if (threads <= 0 || threads > 1024) return -2;
  fibers.resize(threads);
  stacks.resize((size_t)threads * STACK_BYTES);
  exchange[0].assign(threads, 0.f);
  exchange[1].assign(threads, 0.f);
  for (unsigned z = 0; z < grid_dim.z; ++z)
    for (unsigned y = 0; y < grid_dim.y; ++y)
      for (unsigned x = 0; x < grid_dim.x; ++x) {
        block_idx = dim3{x, y, z};
        if (run_block(threads) != 0) return -1;
      }
  return 0;
}

template <class... A, size_t... I>
void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// geometry: grid x, y, z, block x, y, z; args: a pointer to each argument's value.
template <class... A>
int launch(void (*kernel)(A...), const unsigned* geometry, void** args) {
  grid_dim = dim3{geometry[0], geometry[1], geometry[2]};
  block_dim = dim3{geometry[3], geometry[4], geometry[5]};
  body = [=] { call(kernel, args, std::index_sequence_for<A...>{}); };
  return run_grid();
}

}  // namespace sim

#define threadIdx sim::thread_idx
#define blockIdx sim::block_idx
#define blockDim sim::block_dim
#define gridDim sim::grid_dim
#define __syncthreads() sim::wait_at(sim::Wait::block)
#define __shfl_xor_sync(mask, v, s) sim::shuffle_xor((v), (s))
inline int atomicMax(int* p, int v) {
  const int old = *p;
  if (v > old) *p = v;
  return old;
}
