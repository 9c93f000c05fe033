// The Mamba family's step kernels (engine/models/mamba.py forward, one layer's mixer between
// the in_proj, x_proj, dt_proj and out_proj products).
//
// A step's tokens come in row segments: step row r's tokens are row_first[r] ..
// row_first[r] + row_tokens[r] - 1, and its state slot is row_ids[r]; token_row[t] names a
// token's step row (engine/drivers/base.py StepArrays). Per layer, the conv state is (slots,
// d_conv - 1, d_inner) and the SSM state (slots, d_inner, d_state), both fp32: they carry a
// sequence's whole history. The small per-channel parameters (conv_w (d_inner, d_conv),
// conv_b, dt_bias, D (d_inner), A (d_inner, d_state), already -exp(A_log)) are fp32 too.
// xz (T, 2 d_inner) fp32 is in_proj's output: x, then the gate z.

#include "platform.h"

#define MAMBA_MAX_DS 16

// The causal depthwise convolution, then SiLU: token t (index li in its segment) reads
// window[li + j], j < d_conv, of [the slot's last d_conv - 1 inputs, the segment's inputs],
// acc = conv_b + sum_j window[li + j] conv_w[c, j] in order of j. Writes xs (T, d_inner)
// fp32 (the scan's input) and xs_w in W (x_proj's input). Grid (ceil(d_inner / 128), T),
// block 128.
template <typename W>
__device__ __forceinline__ void mamba_conv(const float* xz, const int* token_row, const int* row_ids,
                                           const int* row_first, const float* conv_w, const float* conv_b,
                                           const float* conv_state, float* xs, W* xs_w, int d_inner, int d_conv) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const size_t t = blockIdx.y;
  if (c >= d_inner) return;
  const int r = token_row[t], first = row_first[r];
  const size_t slot = row_ids[r];
  const int li = (int)t - first;
  float acc = conv_b[c];
  for (int j = 0; j < d_conv; ++j) {
    const int at = li + j;  // the segment's inputs start at window index d_conv - 1
    const float v = at >= d_conv - 1 ? xz[(size_t)(first + at - (d_conv - 1)) * 2 * d_inner + c]
                                     : conv_state[(slot * (d_conv - 1) + at) * d_inner + c];
    acc += v * conv_w[(size_t)c * d_conv + j];
  }
  const float y = acc / (1.f + expf(-acc));
  xs[t * d_inner + c] = y;
  xs_w[t * d_inner + c] = from_f<W>(y);
}

// The conv state after the step: slot s <- window[n + s], n = the row's tokens, in
// increasing s (window index n + s > s: no earlier write touched it). Runs after
// mamba_conv. Grid (ceil(d_inner / 128), R), block 128.
__device__ __forceinline__ void mamba_conv_state(const float* xz, const int* row_ids, const int* row_first,
                                                 const int* row_tokens, float* conv_state, int d_inner, int d_conv) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (c >= d_inner) return;
  const int n = row_tokens[r], first = row_first[r];
  float* state = conv_state + (size_t)row_ids[r] * (d_conv - 1) * d_inner + c;
  for (int s = 0; s < d_conv - 1; ++s) {
    const int at = n + s;
    state[(size_t)s * d_inner] = at >= d_conv - 1 ? xz[(size_t)(first + at - (d_conv - 1)) * 2 * d_inner + c]
                                                  : state[(size_t)at * d_inner];
  }
}

// The selective scan over each row's tokens in order, from and back to its SSM state:
// dt = softplus(dtr + dt_bias), h[s] = exp(dt A[c, s]) h[s] + (dt x) B[s], y = sum_s h[s]
// C[s] + x D[c], out = y silu(z). dbc (T, dbc_stride) fp32 is x_proj's output: dt's
// low-rank input (dt_rank), B (d_state), C (d_state); dtr (T, d_inner) fp32 is dt_proj's
// output; y (T, d_inner) in W (out_proj's input). d_state <= MAMBA_MAX_DS. Grid
// (ceil(d_inner / 64), R), block 64.
template <typename W>
__device__ __forceinline__ void mamba_scan(const float* xs, const float* dbc, const float* dtr, const float* xz,
                                           const int* row_ids, const int* row_first, const int* row_tokens,
                                           const float* dt_bias, const float* a_ssm, const float* d_skip,
                                           float* ssm_state, W* y, int d_inner, int d_state, int dt_rank,
                                           int dbc_stride) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (c >= d_inner) return;
  float* state = ssm_state + ((size_t)row_ids[r] * d_inner + c) * d_state;
  float h[MAMBA_MAX_DS], a[MAMBA_MAX_DS];
#pragma unroll
  for (int s = 0; s < MAMBA_MAX_DS; ++s) {
    h[s] = s < d_state ? state[s] : 0.f;
    a[s] = s < d_state ? a_ssm[(size_t)c * d_state + s] : 0.f;
  }
  const float bias = dt_bias[c], skip = d_skip[c];
  const int first = row_first[r];
  for (int u = first; u < first + row_tokens[r]; ++u) {
    const float raw = dtr[(size_t)u * d_inner + c] + bias;
    const float dt = fmaxf(raw, 0.f) + log1pf(expf(-fabsf(raw)));  // softplus, no overflow
    const float xv = xs[(size_t)u * d_inner + c];
    const float dx = dt * xv;
    const float* b = dbc + (size_t)u * dbc_stride + dt_rank;
    float out = 0.f;
#pragma unroll
    for (int s = 0; s < MAMBA_MAX_DS; ++s) {
      if (s < d_state) {
        h[s] = h[s] * expf(dt * a[s]) + dx * b[s];
        out += h[s] * b[d_state + s];
      }
    }
    out += xv * skip;
    const float z = xz[(size_t)u * 2 * d_inner + d_inner + c];
    y[(size_t)u * d_inner + c] = from_f<W>(out * (z / (1.f + expf(-z))));
  }
#pragma unroll
  for (int s = 0; s < MAMBA_MAX_DS; ++s)
    if (s < d_state) state[s] = h[s];
}

extern "C" __global__ void __launch_bounds__(128)
mamba_conv_state_f32(const float* xz, const int* row_ids, const int* row_first, const int* row_tokens,
                     float* conv_state, int d_inner, int d_conv) {
  mamba_conv_state(xz, row_ids, row_first, row_tokens, conv_state, d_inner, d_conv);
}

#define MAMBA_KERNELS(SUFFIX, W)                                                                         \
  extern "C" __global__ void __launch_bounds__(128)                                                     \
  mamba_conv_##SUFFIX(const float* xz, const int* token_row, const int* row_ids, const int* row_first,  \
                      const float* conv_w, const float* conv_b, const float* conv_state, float* xs,     \
                      W* xs_w, int d_inner, int d_conv) {                                               \
    mamba_conv<W>(xz, token_row, row_ids, row_first, conv_w, conv_b, conv_state, xs, xs_w, d_inner,     \
                  d_conv);                                                                              \
  }                                                                                                     \
  extern "C" __global__ void __launch_bounds__(64)                                                      \
  mamba_scan_##SUFFIX(const float* xs, const float* dbc, const float* dtr, const float* xz,             \
                      const int* row_ids, const int* row_first, const int* row_tokens,                  \
                      const float* dt_bias, const float* a, const float* d_skip, float* ssm_state,      \
                      W* y, int d_inner, int d_state, int dt_rank, int dbc_stride) {                    \
    mamba_scan<W>(xs, dbc, dtr, xz, row_ids, row_first, row_tokens, dt_bias, a, d_skip, ssm_state, y,   \
                  d_inner, d_state, dt_rank, dbc_stride);                                               \
  }

MAMBA_KERNELS(f16, f16_word)
MAMBA_KERNELS(bf16, bf16_word)
