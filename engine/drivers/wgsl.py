"""The wgpu driver's compute kernels, in WGSL.

Every kernel is barrier-free: one invocation computes a small tile in registers (lavapipe,
Mesa's software Vulkan, ran register-tiled kernels without workgroup barriers about 3x
faster than shared-memory tiles with barriers). Sizes a kernel loops over are substituted
into its source as constants when the driver prepares it, so a shape never reaches a step.

Every bind group starts with the same two uniforms: `p`, the kernel's fixed parameters
(written once in prepare), and `st`, the step's token and logit counts (written once per
step). The step's flat index arrays (tokens, positions, KV slots, row slots, logit indices)
lie in one int32 buffer of sections sized to the plan, `ix`, uploaded once per step.
"""

from __future__ import annotations

from string import Template


def source(template: str, **sizes: int) -> str:
    """A kernel's source with its sizes (${NAME}) substituted."""
    return Template(template).substitute(**sizes)

HEADER = """
struct Params { a: u32, b: u32, c: u32, d: u32, e: u32, f: u32, g: u32, h: u32 }
struct Step { tokens: u32, logits: u32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> st: Step;
"""

# Sections of the step's index buffer, each TMAX long: tokens, positions, kv_slots,
# row slot of each token, logit indices.
INDEX = """
const TMAX: u32 = ${TMAX}u;
fn tok(t: u32) -> u32 { return u32(ix[t]); }
fn pos(t: u32) -> u32 { return u32(ix[TMAX + t]); }
fn kv_slot(t: u32) -> u32 { return u32(ix[2u * TMAX + t]); }
fn row_slot(t: u32) -> u32 { return u32(ix[3u * TMAX + t]); }
fn logit_tok(i: u32) -> u32 { return u32(ix[4u * TMAX + i]); }
"""
INDEX_SECTIONS = 5


def _matmul(tile: int) -> str:
    """y[t, off + o] (+)= sum_k W[o, k] x[t, k] for a window of W's rows: each invocation
    computes 4 outputs for `tile` tokens. p: a = rows O, b = K / 4, c = y's row stride,
    d = column offset, e = accumulate (the residual add), f = 1: count logits, not tokens."""
    ts = range(tile)
    decl = "\n".join(f"  var acc{j} = vec4<f32>(0.0);" for j in ts)
    rows = "\n".join(f"  let x{j} = (min(t0 + {j}u, T - 1u)) * K4;" for j in ts)
    body = "\n".join("    { let xv = x[xJ + k]; accJ += vec4<f32>(dot(w0, xv), dot(w1, xv), dot(w2, xv), dot(w3, xv)); }"
                     .replace("J", str(j)) for j in ts)
    store = "\n".join("  if (t0 + Ju < T) { store(t0 + Ju, o0, accJ); }".replace("J", str(j)) for j in ts)
    return HEADER + """
@group(0) @binding(2) var<storage, read> w: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

fn store(t: u32, o0: u32, v: vec4<f32>) {
  for (var i = 0u; i < 4u; i++) {
    if (o0 + i < p.a) {
      let idx = t * p.c + p.d + o0 + i;
      if (p.e == 1u) { y[idx] = y[idx] + v[i]; } else { y[idx] = v[i]; }
    }
  }
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let O = p.a;
  let K4 = p.b;
  var T = st.tokens;
  if (p.f == 1u) { T = st.logits; }
  let o0 = gid.x * 4u;
  let t0 = gid.y * """ + str(tile) + """u;
  if (o0 >= O || t0 >= T) { return; }
  let r0 = min(o0, O - 1u) * K4;
  let r1 = min(o0 + 1u, O - 1u) * K4;
  let r2 = min(o0 + 2u, O - 1u) * K4;
  let r3 = min(o0 + 3u, O - 1u) * K4;
""" + decl + "\n" + rows + """
  for (var k = 0u; k < K4; k++) {
    let w0 = w[r0 + k];
    let w1 = w[r1 + k];
    let w2 = w[r2 + k];
    let w3 = w[r3 + k];
""" + body + """
  }
""" + store + "\n}\n"


MATMUL_TILES = (1, 4)  # tokens per invocation: 1 for decode-sized steps, 4 for the rest
MATMUL = {tile: _matmul(tile) for tile in MATMUL_TILES}

# Gathers embedding rows for the tokens a window of the table holds. p: a = D / 4,
# b = the window's first row, c = its rows.
EMBED = HEADER + """
@group(0) @binding(2) var<storage, read> e: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> ix: array<i32>;
@group(0) @binding(4) var<storage, read_write> x: array<vec4<f32>>;
""" + INDEX + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * p.a) { return; }
  let t = i / p.a;
  let k = i % p.a;
  let id = tok(t);
  if (id < p.b || id >= p.b + p.c) { return; }
  x[i] = e[(id - p.b) * p.a + k];
}
"""

# x / rms(x) per token. p: a = D / 4, b = 1: the final norm (rows at the logit indices,
# times the norm's weight), c = eps (f32 bits).
RMS = HEADER + """
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> ix: array<i32>;
@group(0) @binding(4) var<storage, read> nw: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> y: array<vec4<f32>>;
""" + INDEX + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  var n = st.tokens;
  if (p.b == 1u) { n = st.logits; }
  if (i >= n) { return; }
  var src = i;
  if (p.b == 1u) { src = logit_tok(i); }
  var ss = 0.0;
  for (var k = 0u; k < p.a; k++) { let v = x[src * p.a + k]; ss += dot(v, v); }
  let r = sqrt(ss / f32(p.a * 4u) + bitcast<f32>(p.c));
  for (var k = 0u; k < p.a; k++) {
    var v = x[src * p.a + k] / r;
    if (p.b == 1u) { v = v * nw[k]; }
    y[i * p.a + k] = v;
  }
}
"""

# Rotary on each (Q or K) head's adjacent pairs, K and V written to the layer's cache at
# each token's slot. One invocation per pair.
ROPE_STORE = HEADER + """
@group(0) @binding(2) var<storage, read> qkv: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read> ix: array<i32>;
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> q: array<vec2<f32>>;
@group(0) @binding(6) var<storage, read_write> kc: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> vc: array<vec2<f32>>;
""" + INDEX + """
const HEADS: u32 = ${HEADS}u;
const KVH: u32 = ${KVH}u;
const HALF: u32 = ${HALF}u;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  let per_token = (HEADS + KVH) * HALF;
  if (i >= st.tokens * per_token) { return; }
  let t = i / per_token;
  let hh = (i % per_token) / HALF;
  let j = i % HALF;
  let cs = rope[pos(t) * HALF + j];
  let width = (HEADS + 2u * KVH) * HALF;  // qkv's row, in pairs
  let v = qkv[t * width + hh * HALF + j];
  let r = vec2<f32>(v.x * cs.x - v.y * cs.y, v.x * cs.y + v.y * cs.x);
  if (hh < HEADS) {
    q[t * HEADS * HALF + hh * HALF + j] = r;
  } else {
    let kh = hh - HEADS;
    let at = kv_slot(t) * KVH * HALF + kh * HALF + j;
    kc[at] = r;
    vc[at] = qkv[t * width + (HEADS + KVH + kh) * HALF + j];
  }
}
"""

# Paged attention over mixed rows: one invocation per (token, head) reads its row's keys
# 0..position through the row's block table (resident since open_row), online softmax,
# nothing gathered. Q is pre-scaled. p: unused.
ATTENTION = HEADER + """
@group(0) @binding(2) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> kc: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> vc: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> ix: array<i32>;
@group(0) @binding(6) var<storage, read> tables: array<i32>;
@group(0) @binding(7) var<storage, read_write> o: array<vec4<f32>>;
""" + INDEX + """
const HEADS: u32 = ${HEADS}u;
const GROUP: u32 = ${GROUP}u;
const KVH: u32 = ${KVH}u;
const HD4: u32 = ${HD4}u;
const BS: u32 = ${BS}u;
const MAXB: u32 = ${MAXB}u;
@compute @workgroup_size(16)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * HEADS) { return; }
  let t = i / HEADS;
  let h = i % HEADS;
  let kh = h / GROUP;
  let row = row_slot(t) * MAXB;
  var qv: array<vec4<f32>, HD4>;
  var acc: array<vec4<f32>, HD4>;
  for (var d = 0u; d < HD4; d++) { qv[d] = q[(t * HEADS + h) * HD4 + d]; acc[d] = vec4<f32>(0.0); }
  var m = -3.0e38;
  var l = 0.0;
  let n = pos(t) + 1u;
  for (var k = 0u; k < n; k++) {
    let slot = u32(tables[row + k / BS]) * BS + k % BS;
    let base = (slot * KVH + kh) * HD4;
    var s = 0.0;
    for (var d = 0u; d < HD4; d++) { s += dot(qv[d], kc[base + d]); }
    let mn = max(m, s);
    let c = exp(m - mn);
    let e = exp(s - mn);
    l = l * c + e;
    for (var d = 0u; d < HD4; d++) { acc[d] = acc[d] * c + e * vc[base + d]; }
    m = mn;
  }
  for (var d = 0u; d < HD4; d++) { o[(t * HEADS + h) * HD4 + d] = acc[d] / l; }
}
"""

# silu(gate) * up over (T, 2I) -> (T, I). p: a = I.
SILU_MUL = HEADER + """
@group(0) @binding(2) var<storage, read> gu: array<f32>;
@group(0) @binding(3) var<storage, read_write> act: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= st.tokens * p.a) { return; }
  let t = i / p.a;
  let j = i % p.a;
  let g = gu[t * 2u * p.a + j];
  act[i] = g / (1.0 + exp(-g)) * gu[t * 2u * p.a + p.a + j];
}
"""
