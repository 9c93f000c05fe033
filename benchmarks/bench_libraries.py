"""SmolLM2's weight products and a prompt's causal attention on every float32 library installed
here, against this machine's GEMM rate: how much of the GEMM ceiling the best kernels anyone
ships reach on the shapes a step has, before any of the step's own work.

    .venv/bin/python benchmarks/bench_libraries.py [--prompt 512] [--context 256] [--seconds 2] [--rounds 2]
        [--libraries driver,openblas,mkl,onnxruntime,torch,onednn] [--json PATH]

    (the optional libraries: .venv/bin/pip install onnx onnxruntime torch)

Libraries (each measured in a process of its own, so no two thread pools share the cores):
- driver: the NumPy driver's own products (its few-token kernel for 1-12 tokens, MKL's packed
  products above) and its prefill attention (MKL's batched tiles and the compiled causal
  softmax), exactly as a step calls them;
- openblas: NumPy's BLAS, W @ X;
- mkl: oneMKL's packed products (cblas_sgemm_compute) at every token count (needs the mkl wheel);
- onnxruntime: MLAS, a MatMul graph over the model's weights held as constant initializers,
  so ONNX Runtime prepacks them (needs onnxruntime and onnx);
- torch: F.linear (MKL underneath) and F.scaled_dot_product_attention, its fused causal
  attention kernel (needs torch);
- onednn: torch's oneDNN linear on weights reordered once into oneDNN's blocked layout.
A library that is not installed is listed as such; none is required.

Each library's products are the whole step's: for every layer the fused QKV, output,
gate-and-up and down projections, then the output head for every token when the tokens are
decode rows (at most the plan's rows) or for the last one when they are a prompt. The token
counts are 1, 32 (the plan's full rows), the plan's token budget and idle budget (its two
prefill chunk sizes) and the prompt. Attention is one prompt of PROMPT tokens, causal, over
all layers (SmolLM2's 9 query heads on 3 KV heads). `%gemm` is the useful FLOPs over the
time, over the best GEMM rate seen in this run (a 2048^3 product on OpenBLAS or MKL);
causal attention counts only the keys each query sees.

The closing lines put the two many-token targets of a step against the fastest library at
each shape: the whole step at full rows must reach 45% of the GEMM ceiling (shown with the
products alone, then with one read of every row's KV at CONTEXT tokens at the best bandwidth
measured), a prompt's prefill 70% (the fastest products and the fastest causal attention,
in one step and at the plan's idle chunk). Every library's products are also checked against a float64 product of the
same weights, so a fast wrong result cannot win.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_smollm2 import Ceilings, _timeit  # noqa: E402

LIBRARIES = ("driver", "openblas", "mkl", "onnxruntime", "torch", "onednn")
FULL_ROWS_TARGET, PREFILL_TARGET = 0.45, 0.70


class Unavailable(Exception):
    pass


def _model():
    """The default model's weights as a step uses them (fused, norms folded) and its plan."""
    from poot.engine.drivers.cpu import CpuDriver
    from poot.engine.models import load_model
    from poot.engine.models.llama import prepare
    from poot.engine.plan import fit_plan

    model = load_model(None)
    driver = CpuDriver()
    plan = fit_plan(driver.device(), model.config, driver.weight_bytes(model), model.name)
    w = prepare(model.config, model.weights, plan.positions)
    names = ("wqkv", "wo", "w_gate_up", "w_down")
    layers = [{n: w[f"layers.{i}.{n}"] for n in names} for i in range(model.config.num_layers)]
    return model.config, SimpleNamespace(layers=layers, lm_head=w["lm_head"]), plan


def step_weights(prepared) -> list[np.ndarray]:
    return [w for layer in prepared.layers for w in (layer["wqkv"], layer["wo"], layer["w_gate_up"], layer["w_down"])]


def product_flops(config, prepared, tokens: int, logits: int) -> int:
    layers = sum(w.size for w in step_weights(prepared))
    return 2 * (tokens * layers + logits * prepared.lm_head.size)


def attention_flops(config, prompt: int) -> int:
    # QK^T and PV over the keys each query sees (causal): prompt * (prompt + 1) / 2 pairs.
    return 2 * 2 * config.num_layers * config.num_heads * config.head_dim * prompt * (prompt + 1) // 2


def _inputs(config, tokens: int):
    rng = np.random.default_rng(tokens)
    x = (rng.standard_normal((config.hidden_size, tokens)) * 0.5).astype(np.float32)
    act = (rng.standard_normal((config.intermediate_size, tokens)) * 0.5).astype(np.float32)
    return x, act


# ---- each library: products(tokens, logits) -> callable, attention(q, k, v) -> callable -----

class Library:
    """One library's way of computing the step's products (feature-major x: (in, tokens))."""

    def __init__(self, config, prepared):
        self.config, self.prepared = config, prepared

    def product(self, w: np.ndarray, head: bool):
        """Returns f(x) -> w @ x (any layout the library likes); built once per weight."""
        raise NotImplementedError

    def convert(self, x: np.ndarray):
        return x

    def attention(self, q, k, v):
        return None

    def products(self, tokens: int, logits: int):
        p = self.prepared
        layer_fns = [[self.product(layer[n], False) for n in ("wqkv", "wo", "w_gate_up", "w_down")]
                     for layer in p.layers]
        head = self.product(p.lm_head, True)
        x, act = _inputs(self.config, tokens)
        x, act, x_head = self.convert(x), self.convert(act), self.convert(np.ascontiguousarray(x[:, :logits]))

        def run():
            for qkv, wo, gate_up, down in layer_fns:
                qkv(x)
                wo(x)
                gate_up(x)
                down(act)
            return head(x_head)
        return run

    def check(self) -> float:
        """Largest error of one layer's products at 32 tokens, relative to the float64 result's
        largest magnitude."""
        x, _ = _inputs(self.config, 32)
        w = self.prepared.layers[0]["w_gate_up"]
        got = np.asarray(self.result(self.product(w, False)(self.convert(x))), dtype=np.float64)
        want = w.astype(np.float64) @ x.astype(np.float64)
        return float(np.abs(got.reshape(want.shape) - want).max() / np.abs(want).max())

    def result(self, y):
        return y


class Driver(Library):
    def __init__(self, config, prepared):
        super().__init__(config, prepared)
        from poot.engine.drivers.cpu.glue import Glue
        from poot.engine.drivers.cpu.platform import mkl
        from poot.engine.drivers.cpu.products import ModelProducts
        from poot.engine.drivers.cpu.runtime import shared

        runtime = shared()
        if not runtime.available():
            raise Unavailable(runtime.unavailable_reason())
        weights = {f"w{i}": w for i, w in enumerate(step_weights(prepared))} | {"lm_head": prepared.lm_head}
        self.names = {id(w): name for name, w in weights.items()}
        self.products = ModelProducts(weights, [n for n in weights if n != "lm_head"], runtime, head="lm_head")
        self.glue = Glue(runtime, shared_pool=mkl.available())

    def product(self, w, head):
        return self.products[self.names[id(w)]].run  # the head's logits token-major

    def attention(self, q, k, v):
        from poot.engine.drivers.cpu import attention

        c = self.config
        prompt = q.shape[2]
        blocks = -(-prompt // 16)
        caches = []
        for layer in range(c.num_layers):  # a cache per layer, as a step reads them
            cache = np.zeros(attention.kv_cache_shape({"kv_heads": c.num_kv_heads, "head_dim": c.head_dim}, blocks, 16), np.float32)
            cache[0].reshape(c.num_kv_heads, -1, c.head_dim)[:, :prompt] = k[layer]
            cache[1].reshape(c.num_kv_heads, -1, c.head_dim)[:, :prompt] = v[layer]
            caches.append(cache)
        qs = [np.ascontiguousarray(q[layer].transpose(1, 0, 2)) for layer in range(c.num_layers)]  # (T, heads, hd)
        table = np.arange(blocks, dtype=np.int64)

        def run():
            for layer in range(c.num_layers):
                attention.attention(np, qs[layer], caches[layer], None, [(0, prompt, prompt, table, None)],
                                    c.num_kv_heads, self.glue)
        return run


class OpenBLAS(Library):
    def product(self, w, head):
        return lambda x: w @ x


class MKL(Library):
    def __init__(self, config, prepared):
        super().__init__(config, prepared)
        from poot.engine.drivers.cpu.platform import mkl as mkl_products

        if not mkl_products.available():
            raise Unavailable(mkl_products.unavailable_reason())
        self.mkl = mkl_products

    def product(self, w, head):
        packed = self.mkl.PackedWeight(w)
        return lambda x: self.mkl.matmul(packed, x)


class OnnxRuntime(Library):
    """The products as one ONNX graph per token count: the weights are constant initializers,
    which ONNX Runtime prepacks for MLAS when the session starts."""

    def __init__(self, config, prepared):
        super().__init__(config, prepared)
        try:
            import onnx  # noqa: F401
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise Unavailable(f"not installed ({e.name})") from None

    def product(self, w, head):
        session = self._session([w])
        return lambda x: session.run(None, {"x0": x})[0]

    def result(self, y):
        return y.T

    def convert(self, x):
        return np.ascontiguousarray(x.T)  # token-major, as MatMul(x, W^T) takes it

    def _session(self, weights, inputs=None):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        inputs = inputs or [0] * len(weights)
        widths = sorted({(i, weights[j].shape[1]) for j, i in enumerate(inputs)})
        def rows(i):  # x2 carries only the tokens that need logits
            return "logits" if i == 2 else "tokens"
        graph_inputs = [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [rows(i), width]) for i, width in widths]
        nodes, outputs, inits = [], [], []
        for j, (w, i) in enumerate(zip(weights, inputs, strict=True)):
            inits.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{j}"))
            nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{j}"], [f"y{j}"]))
            outputs.append(helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, [rows(i), w.shape[0]]))
        model = helper.make_model(helper.make_graph(nodes, "products", graph_inputs, outputs, inits),
                                  opset_imports=[helper.make_opsetid("", 17)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = 0  # one per core
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def products(self, tokens, logits):
        # One session runs the whole step (a Python call per product would add its overhead).
        p = self.prepared
        weights, inputs = [], []
        for layer in p.layers:
            weights += [layer["wqkv"], layer["wo"], layer["w_gate_up"], layer["w_down"]]
            inputs += [0, 0, 0, 1]
        session = self._session(weights + [p.lm_head], inputs + [2])
        x, act = _inputs(self.config, tokens)
        feeds = {"x0": self.convert(x), "x1": self.convert(act), "x2": self.convert(np.ascontiguousarray(x[:, :logits]))}
        return lambda: session.run(None, feeds)


class Torch(Library):
    def __init__(self, config, prepared):
        super().__init__(config, prepared)
        try:
            import torch
        except ImportError as e:
            raise Unavailable(f"not installed ({e.name})") from None
        self.torch = torch
        self.f = torch.nn.functional
        torch.set_grad_enabled(False)

    def product(self, w, head):
        tw = self.torch.from_numpy(w)
        return lambda x: self.f.linear(x, tw)

    def convert(self, x):
        return self.torch.from_numpy(np.ascontiguousarray(x.T))

    def result(self, y):
        return y.numpy().T

    def attention(self, q, k, v):
        c = self.config
        tq, tk, tv = (self.torch.from_numpy(np.ascontiguousarray(a))[:, None] for a in (q, k, v))
        groups = c.num_heads // c.num_kv_heads
        tk, tv = tk.repeat_interleave(groups, dim=2), tv.repeat_interleave(groups, dim=2)

        def run():
            for layer in range(c.num_layers):
                self.f.scaled_dot_product_attention(tq[layer], tk[layer], tv[layer], is_causal=True, scale=1.0)
        return run


class OneDNN(Torch):
    def __init__(self, config, prepared):
        super().__init__(config, prepared)
        if not self.torch.backends.mkldnn.is_available():
            raise Unavailable("torch was built without oneDNN")

    def product(self, w, head):
        from torch.utils import mkldnn

        linear = self.torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = self.torch.from_numpy(w)
        fn = mkldnn.to_mkldnn(linear)
        return fn

    def convert(self, x):
        return super().convert(x).to_mkldnn()

    def result(self, y):
        return y.to_dense().numpy().T

    def attention(self, q, k, v):
        return None


CLASSES = {"driver": Driver, "openblas": OpenBLAS, "mkl": MKL, "onnxruntime": OnnxRuntime, "torch": Torch,
           "onednn": OneDNN}


def measure(name: str, prompt: int, seconds: float) -> dict:
    """One library, in this process: its error and best time at every token count."""
    config, prepared, plan = _model()
    counts = sorted({1, plan.rows, plan.token_budget, plan.max_step_tokens, prompt})
    try:
        lib = CLASSES[name](config, prepared)
    except Unavailable as e:
        return {"library": name, "unavailable": str(e)}
    out = {"library": name, "error": lib.check(), "products": {}, "attention": None}
    for tokens in counts:
        logits = tokens if tokens <= plan.rows else 1
        run = lib.products(tokens, logits)
        best = min(_timeit(run, seconds, min_repeats=3))
        out["products"][tokens] = {"s": best, "flops": product_flops(config, prepared, tokens, logits)}
        print(f"  {name}: {tokens} tokens {best * 1e3:.1f} ms", file=sys.stderr, flush=True)
    rng = np.random.default_rng(1)
    c = config
    q = rng.standard_normal((c.num_layers, c.num_heads, prompt, c.head_dim), dtype=np.float32)
    q *= np.float32(1 / np.sqrt(c.head_dim))  # pre-scaled, as the step's queries are
    k = rng.standard_normal((c.num_layers, c.num_kv_heads, prompt, c.head_dim), dtype=np.float32)
    v = rng.standard_normal((c.num_layers, c.num_kv_heads, prompt, c.head_dim), dtype=np.float32)
    run = lib.attention(q, k, v)
    if run is not None:
        out["attention"] = {"s": min(_timeit(run, seconds, min_repeats=3)), "flops": attention_flops(c, prompt)}
    out["plan"] = {"rows": plan.rows, "token_budget": plan.token_budget, "idle": plan.max_step_tokens,
                   "kv_bytes_per_token": config.kv_bytes_per_token()}
    return out


def _child(name: str, args) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--only", name, "--prompt", str(args.prompt),
                           "--seconds", str(args.seconds)], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"library": name, "unavailable": f"failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout)


def merge(best: dict | None, new: dict) -> dict:
    """Keeps the fastest time of each measurement over rounds (noise only adds time)."""
    if best is None or "products" not in best or "products" not in new:
        return new if best is None or "products" in new else best
    for tokens, p in new["products"].items():
        if p["s"] < best["products"][tokens]["s"]:
            best["products"][tokens] = p
    if new["attention"] and new["attention"]["s"] < best["attention"]["s"]:
        best["attention"] = new["attention"]
    best["error"] = max(best["error"], new["error"])
    return best


def run(args) -> dict:
    ceilings = Ceilings()
    ceilings.sample(2.0)
    results: dict[str, dict | None] = dict.fromkeys(args.libraries)
    # Rounds over all libraries, so a burst of load on the shared machine hits one round of
    # each rather than all of one library.
    for round_ in range(args.rounds):
        for name in args.libraries:
            print(f"round {round_ + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
            results[name] = merge(results[name], _child(name, args))
            ceilings.sample(1.0)  # the machine may be shared: keep the best rate seen
    results = list(results.values())
    return {"gemm": ceilings.gemm, "bandwidth": ceilings.bandwidth, "prompt": args.prompt, "results": results,
            "table": table(results, ceilings.gemm, ceilings.bandwidth, args.prompt, args.context)}


def table(results: list[dict], gemm: float, bandwidth: float, prompt: int, context: int) -> str:
    measured = [r for r in results if "products" in r]
    lines = [f"best GEMM rate in this run: {gemm / 1e9:.0f} GFLOP/s; %gemm = useful FLOPs / time / that rate"]
    if not measured:
        return "\n".join(lines + ["no library could be measured"])
    plan = measured[0]["plan"]
    counts = sorted({int(t) for r in measured for t in r["products"]})
    names = {plan["rows"]: "rows", plan["token_budget"]: "budget", plan["idle"]: "idle", prompt: "prompt"}
    labels = [f"{t} {names[t]}" if t in names else str(t) for t in counts]
    head = f"{'library':12} {'max err':>8} " + " ".join(f"{label:>16}" for label in labels) + \
        f" {'attention ' + str(prompt):>18}"
    lines += ["products of a whole step (ms, %gemm) at each token count; causal attention of one prompt", head]
    for r in results:
        if "products" not in r:
            lines.append(f"{r['library']:12} {r['unavailable']}")
            continue
        cells = []
        for t in counts:
            p = r["products"].get(str(t)) or r["products"].get(t)
            cells.append(f"{p['s'] * 1e3:8.1f} {p['flops'] / p['s'] / gemm:6.0%}" if p else f"{'-':>16}")
        a = r["attention"]
        att = f"{a['s'] * 1e3:10.1f} {a['flops'] / a['s'] / gemm:6.0%}" if a else f"{'-':>17}"
        lines.append(f"{r['library']:12} {r['error']:8.1e} " + " ".join(f"{c:>16}" for c in cells) + f" {att:>18}")

    def best(tokens):
        found = [(r["products"].get(str(tokens)) or r["products"].get(tokens), r["library"]) for r in measured]
        return min(((p["s"], p["flops"], lib) for p, lib in found if p), default=None)

    rows = best(plan["rows"])
    if rows:
        share = rows[1] / rows[0] / gemm
        kv_s = plan["rows"] * context * plan["kv_bytes_per_token"] / bandwidth
        lines.append(f"full rows ({plan['rows']}): the fastest products ({rows[2]}) reach {share:.0%} of the GEMM "
                     f"ceiling on their own; with one read of every row's KV at {context} tokens of context "
                     f"({kv_s * 1e3:.1f} ms at {bandwidth / 1e9:.1f} GB/s) {rows[1] / (rows[0] + kv_s) / gemm:.0%}, "
                     f"attention's arithmetic and the glue free; the whole step's target is {FULL_ROWS_TARGET:.0%}")
    attention = min(((r["attention"]["s"], r["library"]) for r in measured if r["attention"]), default=None)
    shapes = [(prompt, "in one step")] + ([(plan["idle"], f"in chunks of {plan['idle']}")] if plan["idle"] < prompt else [])
    for tokens, label in shapes:
        chunk = best(tokens)
        if chunk and attention:
            # The prompt's products at this chunk's rate per token (the engine's last chunk is
            # shorter, not padded); the FLOPs are the whole prompt's.
            products = chunk[0] * prompt / tokens
            flops = best(prompt)[1] if tokens != prompt else chunk[1]
            total = products + attention[0]
            lines.append(f"prefill {prompt} {label}: fastest products ({chunk[2]}) {products * 1e3:.0f} ms + fastest "
                         f"causal attention ({attention[1]}) {attention[0] * 1e3:.0f} ms = {flops / total / gemm:.0%} "
                         f"of the GEMM ceiling with nothing else in the step; the target is {PREFILL_TARGET:.0%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (the prefill's products and attention)")
    ap.add_argument("--context", type=int, default=256, help="tokens of context each decoding row holds")
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent on each measurement")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over all libraries; each cell keeps its best")
    ap.add_argument("--libraries", type=lambda s: s.split(","), default=list(LIBRARIES),
                    help=f"comma-separated, from {','.join(LIBRARIES)}")
    ap.add_argument("--only", choices=LIBRARIES, help=argparse.SUPPRESS)  # the child process's mode
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.only:
        print(json.dumps(measure(args.only, args.prompt, args.seconds)))
        return 0
    result = run(args)
    print(result["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
