// The CUDA driver's step kernels (all but the products, which go through cuBLAS).
//
// Activations are token-major, (tokens, features). Precision, per buffer:
// - the residual stream x, the products' outputs (qkv, gate/up, logits) and rotated q are
//   fp32: the residual adds and the attention logits keep full precision;
// - what a product reads (the normed h, the attention output, the SiLU product) is stored
//   in the weights' 16-bit type W (fp16 or bf16): cublasGemmEx takes A and B of one type,
//   16-bit operands run on the tensor cores, and C comes out fp32 (CUBLAS_COMPUTE_32F);
// - the KV cache is W too (half the memory and bandwidth of fp32).
// Every sum is accumulated in fp32. A bf16 model's words are converted here (W = bf16), so
// each kernel that touches W comes twice: NAME_f16 and NAME_bf16.
//
// KV cache, per layer: K and V each (num_slots, kv_heads, head_dim), slot = block *
// block_size + offset. The block table of every open row is resident, (rows, max_blocks).

#include "platform.h"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int s = LANES / 2; s > 0; s >>= 1) v += lane_xor(v, s);
  return v;
}

// Sum over a block of NORM_THREADS threads; every thread gets the result.
#define NORM_THREADS 256
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[NORM_THREADS / LANES];
  v = warp_sum(v);
  if (threadIdx.x % LANES == 0) part[threadIdx.x / LANES] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < NORM_THREADS / LANES; ++w) s += part[w];
  return s;
}

// x[t, :] = float(table[tokens[t], :]). Grid (T), block 256.
template <typename W>
__device__ __forceinline__ void embed(const W* table, const int* tokens, float* x, int dim) {
  const size_t t = blockIdx.x;
  const W* row = table + (size_t)tokens[t] * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) x[t * dim + d] = to_f(row[d]);
}

// h[i] = x[src] * rsqrt(mean(x[src]^2) + eps) (* weight), src = rows ? rows[i] : i.
// Grid (rows of h), block NORM_THREADS.
template <typename W>
__device__ __forceinline__ void norm(const float* x, const int* rows, const W* weight, W* h, int dim, float eps) {
  const size_t i = blockIdx.x;
  const float* xr = x + (rows ? (size_t)rows[i] : i) * dim;
  float ss = 0.f;
  for (int d = threadIdx.x; d < dim; d += NORM_THREADS) ss += xr[d] * xr[d];
  const float r = rsqrtf(block_sum(ss) / dim + eps);
  for (int d = threadIdx.x; d < dim; d += NORM_THREADS) {
    const float w = weight ? to_f(weight[d]) : 1.f;
    h[i * dim + d] = from_f<W>(xr[d] * r * w);
  }
}

// Rotary and the cache write. qkv (T, (heads + 2 kv_heads) head_dim) fp32, q and k heads
// in adjacent-pair layout; rope (positions, head_dim / 2, 2) fp32: cos, sin of pos theta_j.
// Rotated q goes to q_out (T, heads head_dim) fp32; rotated k and plain v go to the cache
// at kv_slots[t] (a negative slot writes nothing). Grid (T), block 128, a thread per pair.
template <typename W>
__device__ __forceinline__ void rope_kv_write(const float* qkv, const float* rope, const int* positions,
                                              const int* kv_slots, float* q_out, W* k_cache, W* v_cache,
                                              int heads, int kv_heads, int head_dim) {
  const size_t t = blockIdx.x;
  const int half = head_dim >> 1;
  const int width = (heads + 2 * kv_heads) * head_dim;
  const float2* cs = reinterpret_cast<const float2*>(rope) + (size_t)positions[t] * half;
  const float2* in = reinterpret_cast<const float2*>(qkv + t * width);
  const int slot = kv_slots[t];
  const size_t kv_at = (size_t)(slot < 0 ? 0 : slot) * kv_heads * head_dim;
  for (int i = threadIdx.x; i < (heads + 2 * kv_heads) * half; i += blockDim.x) {
    const float2 v = in[i];
    if (i >= (heads + kv_heads) * half) {  // v: copied as it is
      if (slot >= 0) {
        const size_t o = kv_at + 2 * (size_t)(i - (heads + kv_heads) * half);
        v_cache[o] = from_f<W>(v.x);
        v_cache[o + 1] = from_f<W>(v.y);
      }
      continue;
    }
    const float2 c = cs[i % half];
    const float re = v.x * c.x - v.y * c.y, im = v.x * c.y + v.y * c.x;
    if (i < heads * half) {
      reinterpret_cast<float2*>(q_out + t * heads * head_dim)[i] = make_float2(re, im);
    } else if (slot >= 0) {
      const size_t o = kv_at + 2 * (size_t)(i - heads * half);
      k_cache[o] = from_f<W>(re);
      k_cache[o + 1] = from_f<W>(im);
    }
  }
}

// Paged attention over a mixed step: block (t, h) is query head h of token t, which
// attends keys 0..positions[t] of its own row (row_slot[t]: the row slot as opened, an
// index into tables), read in place through the row's block table, never past its
// position. q is pre-scaled (1/sqrt(head_dim) is folded into the weights). Each of the
// ATT_WARPS warps runs an online softmax over every ATT_WARPS-th key, lane i holding the
// dimensions i, i + LANES, ... (head_dim / LANES of them); the warps merge through shared
// memory. out (T, heads head_dim) in W. head_dim <= ATT_MAX_DIM. Grid (T, heads), block
// ATT_WARPS * LANES.
// A faster decode path (one token, long rows) would split each row's keys over several
// blocks (split-K, flash-decoding) and merge their (m, l, acc) in a second kernel; it
// would take the decode tokens, this kernel the prefill chunks.
#define ATT_WARPS 4
#define ATT_MAX_DIM 256
#define ATT_MAX_E (ATT_MAX_DIM / LANES)
template <typename W>
__device__ __forceinline__ void paged_attention(const float* q, const W* k_cache, const W* v_cache,
                                                const int* positions, const int* row_slot, const int* tables,
                                                W* out, int heads, int kv_heads, int head_dim, int block_size,
                                                int max_blocks) {
  __shared__ float sm[ATT_WARPS], sl[ATT_WARPS], sacc[ATT_WARPS][ATT_MAX_DIM];
  const size_t t = blockIdx.x;
  const int h = blockIdx.y;
  const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES;
  const int kh = h / (heads / kv_heads);
  const int n = positions[t] + 1;
  const int* table = tables + (size_t)row_slot[t] * max_blocks;
  const float* qp = q + (t * heads + h) * head_dim;
  float qv[ATT_MAX_E], acc[ATT_MAX_E];
#pragma unroll
  for (int e = 0; e < ATT_MAX_E; ++e) {
    const int d = lane + LANES * e;
    qv[e] = d < head_dim ? qp[d] : 0.f;
    acc[e] = 0.f;
  }
  float m = __int_as_float(0xff800000), l = 0.f;
  for (int k = warp; k < n; k += ATT_WARPS) {
    const size_t slot = (size_t)table[k / block_size] * block_size + k % block_size;
    const size_t base = (slot * kv_heads + kh) * head_dim;
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) {
      const int d = lane + LANES * e;
      if (d < head_dim) s += qv[e] * to_f(k_cache[base + d]);
    }
    s = warp_sum(s);
    const float mn = fmaxf(m, s);
    const float c = expf(m - mn), p = expf(s - mn);
    l = l * c + p;
#pragma unroll
    for (int e = 0; e < ATT_MAX_E; ++e) {
      const int d = lane + LANES * e;
      if (d < head_dim) acc[e] = acc[e] * c + p * to_f(v_cache[base + d]);
    }
    m = mn;
  }
  if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
  for (int e = 0; e < ATT_MAX_E; ++e) {
    const int d = lane + LANES * e;
    if (d < head_dim) sacc[warp][d] = acc[e];
  }
  __syncthreads();
  float mx = sm[0];  // warp 0 always has key 0: the maximum is finite
#pragma unroll
  for (int w = 1; w < ATT_WARPS; ++w) mx = fmaxf(mx, sm[w]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float total = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
      const float f = expf(sm[w] - mx);  // 0 for a warp without keys (m = -inf)
      total += sl[w] * f;
      o += sacc[w][d] * f;
    }
    out[(t * heads + h) * head_dim + d] = from_f<W>(o / total);
  }
}

// act[t, i] = silu(gu[t, i]) * gu[t, inter + i]; gu (T, 2 inter) fp32, act (T, inter) W.
// Grid (ceil(T inter / 256)), block 256.
template <typename W>
__device__ __forceinline__ void silu_mul(const float* gu, W* act, int tokens, int inter) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)tokens * inter) return;
  const size_t t = i / inter, j = i % inter;
  const float g = gu[t * 2 * inter + j];
  act[i] = from_f<W>(g / (1.f + expf(-g)) * gu[t * 2 * inter + inter + j]);
}

// The residual add, for a product written to scratch: x[i] += y[i]. Grid (ceil(n / 256)),
// block 256.
extern "C" __global__ void __launch_bounds__(256) add_f32(float* x, const float* y, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

#define STEP_KERNELS(SUFFIX, W)                                                                      \
  extern "C" __global__ void __launch_bounds__(256)                                                 \
  embed_##SUFFIX(const W* table, const int* tokens, float* x, int dim) {                            \
    embed<W>(table, tokens, x, dim);                                                                \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                        \
  rms_norm_##SUFFIX(const float* x, W* h, int dim, float eps) {                                     \
    norm<W>(x, nullptr, nullptr, h, dim, eps);                                                      \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                        \
  final_norm_##SUFFIX(const float* x, const int* logit_idx, const W* weight, W* h, int dim,         \
                      float eps) {                                                                  \
    norm<W>(x, logit_idx, weight, h, dim, eps);                                                     \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(128)                                                 \
  rope_kv_write_##SUFFIX(const float* qkv, const float* rope, const int* positions,                 \
                         const int* kv_slots, float* q_out, W* k_cache, W* v_cache, int heads,      \
                         int kv_heads, int head_dim) {                                              \
    rope_kv_write<W>(qkv, rope, positions, kv_slots, q_out, k_cache, v_cache, heads, kv_heads,      \
                     head_dim);                                                                     \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(ATT_WARPS * LANES)                                      \
  paged_attention_##SUFFIX(const float* q, const W* k_cache, const W* v_cache, const int* positions, \
                           const int* row_slot, const int* tables, W* out, int heads, int kv_heads, \
                           int head_dim, int block_size, int max_blocks) {                          \
    paged_attention<W>(q, k_cache, v_cache, positions, row_slot, tables, out, heads, kv_heads,      \
                       head_dim, block_size, max_blocks);                                           \
  }                                                                                                 \
  extern "C" __global__ void __launch_bounds__(256)                                                 \
  silu_mul_##SUFFIX(const float* gu, W* act, int tokens, int inter) {                               \
    silu_mul<W>(gu, act, tokens, inter);                                                            \
  }

STEP_KERNELS(f16, f16_word)
STEP_KERNELS(bf16, bf16_word)
