// Picks each logit row's token on the device: engine/sampler.py's rules in float32, with
// the uniform of engine/random_stream.py (Philox4x32-10, bit for bit), as the WGSL PICK.
//
// One block of PICK_THREADS threads per logit row; thread j owns the contiguous ids
// [j * chunk, (j + 1) * chunk), chunk = ceil(vocab / PICK_THREADS), and sums them in id
// order. Block reductions are a fixed shared-memory tree (red[j] += red[j + s], s halving),
// so every float sum has one defined order, which reference.py repeats exactly.
//
// Per row, `words` holds PICK_WORDS uint32 (engine/drivers/base.py pick_words): mode (0
// host: ids = -1, 1 greedy, 2 sampled), key low, key high, choice, counter, temperature
// (f32 bits, already >= 1e-6), top_k (0: none), top_p (f32 bits).
// Greedy: the first id of the largest logit. Sampled: top-k keeps every logit >= the k-th
// largest (ties kept); the row's logits are overwritten in place by their weights
// exp((z - max) / temperature) (0 where cut); top-p keeps every weight >= the largest w
// whose mass of weights >= w is at least top_p * total; the token is the first kept id
// whose running sum (thread chunks' exclusive prefix, then in-chunk running sum) passes
// u * kept total, falling back to the chunk's (or the row's) last kept id under rounding.

#include "platform.h"

#define PICK_THREADS 1024
#define PICK_WORDS 8

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r) { k.x += 0x9E3779B9u; k.y += 0xBB67AE85u; }
    const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}

// The uniform behind a pick: counter (k, 0, choice, 0), key (lo, hi), top 24 bits.
__device__ __forceinline__ float pick_uniform_of(const unsigned* w) {
  const uint4 c = philox4x32_10(make_uint4(w[4], 0u, w[3], 0u), make_uint2(w[1], w[2]));
  return (float)(c.x >> 8) * (1.f / 16777216.f);
}

// An order-preserving key of a float: a < b exactly when key(a) < key(b); -0 is 0.
__device__ __forceinline__ unsigned order_key(float x) {
  unsigned b = __float_as_uint(x);
  if (b == 0x80000000u) b = 0u;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__shared__ float red_f[PICK_THREADS];
__shared__ unsigned red_u[PICK_THREADS];

__device__ __forceinline__ float tree_sum(float v) {
  red_f[threadIdx.x] = v;
  for (int s = PICK_THREADS / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (threadIdx.x < s) red_f[threadIdx.x] += red_f[threadIdx.x + s];
  }
  __syncthreads();
  const float r = red_f[0];
  __syncthreads();
  return r;
}

__device__ __forceinline__ float tree_max(float v) {
  red_f[threadIdx.x] = v;
  for (int s = PICK_THREADS / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (threadIdx.x < s) red_f[threadIdx.x] = fmaxf(red_f[threadIdx.x], red_f[threadIdx.x + s]);
  }
  __syncthreads();
  const float r = red_f[0];
  __syncthreads();
  return r;
}

// op 0: sum, 1: min, 2: max.
__device__ __forceinline__ unsigned tree_u(unsigned v, int op) {
  red_u[threadIdx.x] = v;
  for (int s = PICK_THREADS / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (threadIdx.x < s) {
      const unsigned a = red_u[threadIdx.x], b = red_u[threadIdx.x + s];
      red_u[threadIdx.x] = op == 0 ? a + b : op == 1 ? min(a, b) : max(a, b);
    }
  }
  __syncthreads();
  const unsigned r = red_u[0];
  __syncthreads();
  return r;
}

// logits (L, vocab) fp32, overwritten by weights on sampled rows; words (L, PICK_WORDS)
// uint32; ids (L,) int32. Grid (L), block PICK_THREADS.
extern "C" __global__ void __launch_bounds__(PICK_THREADS) pick(float* logits, const unsigned* words, int* ids,
                                                                  int vocab) {
  const unsigned* w = words + (size_t)blockIdx.x * PICK_WORDS;
  const unsigned mode = w[0];
  if (mode == 0u) {
    if (threadIdx.x == 0) ids[blockIdx.x] = -1;
    return;
  }
  float* z = logits + (size_t)blockIdx.x * vocab;
  const int chunk = (vocab + PICK_THREADS - 1) / PICK_THREADS;
  const int v0 = min((int)threadIdx.x * chunk, vocab), v1 = min(v0 + chunk, vocab);

  float m = __int_as_float(0xff800000);
  unsigned at = (unsigned)vocab;
  for (int v = v0; v < v1; ++v) {
    if (z[v] > m) { m = z[v]; at = v; }
  }
  const float top = tree_max(m);
  const unsigned first = tree_u(m == top ? at : (unsigned)vocab, 1);
  if (mode == 1u) {
    if (threadIdx.x == 0) ids[blockIdx.x] = (int)first;
    return;
  }

  const float temperature = __uint_as_float(w[5]), top_p = __uint_as_float(w[7]);
  const unsigned top_k = w[6];
  // Top-k's threshold key, bit by bit: the largest key with at least top_k keys >= it. It
  // stops once the set it keeps cannot change: exactly top_k at or above the threshold,
  // or one token between the threshold and the smallest rejected candidate.
  unsigned kth = 0u;
  if (top_k > 0u && top_k < (unsigned)vocab) {
    unsigned at_t = (unsigned)vocab, at_up = 0u;
    for (int b = 0; b < 32; ++b) {
      const unsigned cand = kth | (0x80000000u >> b);
      unsigned n = 0u;
      for (int v = v0; v < v1; ++v) n += order_key(z[v]) >= cand;
      const unsigned count = tree_u(n, 0);
      if (count >= top_k) { kth = cand; at_t = count; } else { at_up = count; }
      if (at_t == top_k || at_t - at_up == 1u) break;
    }
  }
  float s = 0.f;
  for (int v = v0; v < v1; ++v) {
    const float x = z[v];
    const float e = order_key(x) >= kth ? expf((x - top) / temperature) : 0.f;
    z[v] = e;
    s += e;
  }
  const float total = tree_sum(s);
  // Top-p's threshold over the weights' bits (non-negative floats order as their bits;
  // weights lie in [0, 1], so the top two bits are 0), the same stopping rule.
  unsigned cut = 0u;
  if (top_p < 1.f) {
    const float need = top_p * total;
    unsigned at_t = (unsigned)vocab, at_up = 0u;
    for (int b = 2; b < 32; ++b) {
      const unsigned cand = cut | (0x80000000u >> b);
      float mass = 0.f;
      unsigned n = 0u;
      for (int v = v0; v < v1; ++v) {
        const float e = z[v];
        if (__float_as_uint(e) >= cand) { mass += e; ++n; }
      }
      const float got = tree_sum(mass);
      const unsigned count = tree_u(n, 0);
      if (got >= need) { cut = cand; at_t = count; } else { at_up = count; }
      if (at_t - at_up == 1u) break;
    }
  }

  float mine = 0.f;
  int last_here = -1;
  for (int v = v0; v < v1; ++v) {
    const float e = z[v];
    if (e > 0.f && __float_as_uint(e) >= cut) { mine += e; last_here = v; }
  }
  __shared__ float kept;
  __shared__ int found;
  red_f[threadIdx.x] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix of the chunks' sums, in id order
    float run = 0.f;
    for (int j = 0; j < PICK_THREADS; ++j) {
      const float x = red_f[j];
      red_f[j] = run;
      run += x;
    }
    kept = run;
    found = -1;
  }
  __syncthreads();
  const float goal = pick_uniform_of(w) * kept;
  const float before = red_f[threadIdx.x];
  if (mine > 0.f && before <= goal && goal < before + mine) {
    float run = before;
    int pk = last_here;
    for (int v = v0; v < v1; ++v) {
      const float e = z[v];
      if (e > 0.f && __float_as_uint(e) >= cut) {
        run += e;
        if (run > goal) { pk = v; break; }
      }
    }
    atomicMax(&found, pk);
  }
  const unsigned last = tree_u(last_here < 0 ? 0u : (unsigned)last_here, 2);
  if (threadIdx.x == 0) ids[blockIdx.x] = found >= 0 ? found : (int)last;
}

// The uniform of each row's pick (for tests and host-side checks): u (L,) fp32.
// Grid (ceil(L / 256)), block 256.
extern "C" __global__ void __launch_bounds__(256) pick_uniform(const unsigned* words, float* u, int rows) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < rows) u[i] = pick_uniform_of(words + (size_t)i * PICK_WORDS);
}
