"""Seeded, reproducible workloads: arrival times, prompt and output lengths, prompt text.

A workload is a list of request specs built by a pure function of a `LoadConfig`; the same
config (seed included) always yields the same list, on every machine. Each random aspect draws
from its own named stream, so changing, say, the output-length distribution does not move the
arrival times.

Prompt lengths are in tokens, turned into text with `chars_per_token` characters per token
(1.0 fits the byte-level tokenizer of the synthetic model; about 4 fits English BPE tokenizers).
The server's usage counts, recorded per request, are the ground truth.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace

WORDS = ("the of and to in is was for on are with as by at from this that have not but all "
         "model token batch cache block queue prefill decode stream server client request "
         "latency throughput memory kernel schedule slot page prefix draft verify accept "
         "river stone cloud light paper garden window letter orange silver winter market").split()


@dataclass(frozen=True)
class Lengths:
    """A bounded length distribution: "uniform" on [lo, hi], or "lognormal" with the given
    median and sigma (of the underlying normal), clipped to [lo, hi]."""

    kind: str = "uniform"
    lo: int = 16
    hi: int = 128
    median: float = 64.0
    sigma: float = 0.8

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        if self.kind == "lognormal":
            x = rng.lognormvariate(math.log(self.median), self.sigma)
            return int(min(self.hi, max(self.lo, round(x))))
        if self.kind == "fixed":
            return self.lo
        raise ValueError(f"unknown length distribution {self.kind!r}")

    @staticmethod
    def parse(text: str) -> Lengths:
        """"uniform:LO:HI", "lognormal:MEDIAN:SIGMA:LO:HI" or "fixed:N"."""
        parts = text.split(":")
        try:
            if parts[0] == "uniform" and len(parts) == 3:
                return Lengths("uniform", int(parts[1]), int(parts[2]))
            if parts[0] == "lognormal" and len(parts) == 5:
                return Lengths("lognormal", int(parts[3]), int(parts[4]), float(parts[1]), float(parts[2]))
            if parts[0] == "fixed" and len(parts) == 2:
                return Lengths("fixed", int(parts[1]), int(parts[1]))
        except ValueError:
            pass
        raise ValueError(f"bad length spec {text!r}: use uniform:LO:HI, lognormal:MEDIAN:SIGMA:LO:HI or fixed:N")


@dataclass(frozen=True)
class LoadConfig:
    scenario: str = "poisson"
    seed: int = 0
    requests: int = 40
    mode: str = "open"              # "open": arrivals at `rate`; "closed": `concurrency` loops
    rate: float = 4.0               # requests/s for open loop
    concurrency: int = 4            # closed loop users; open loop: most requests in flight
    prompt: Lengths = Lengths("uniform", 32, 160)
    output: Lengths = Lengths("uniform", 16, 160)
    max_context: int = 512          # prompt + output are clipped to fit
    shared_prefix: int = 0          # tokens of a system prompt every request starts with
    disconnect_share: float = 0.0   # share of requests whose client leaves early
    burst: int = 0                  # long-prompt requests arriving together at `burst_at`
    burst_at: float = 0.5
    burst_prompt: int = 440
    decoders: int = 0               # long-output streams started at t=0 (burst scenario)
    decoder_output: int = 400
    quote: bool = False             # prompts ask to repeat a passage they contain
    chars_per_token: float = 1.0
    endpoint: str = "completions"   # or "chat"
    model: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    timeout_s: float = 60.0         # per request
    cycle: bool = False             # closed loop: start the list again when it is used up (the
                                    # run then ends at its time bound only)

    def as_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> LoadConfig:
        d = dict(d)
        for key in ("prompt", "output"):
            if isinstance(d.get(key), dict):
                d[key] = Lengths(**d[key])
        return LoadConfig(**d)


@dataclass
class RequestSpec:
    id: int
    kind: str                       # main | decode | burst | quote
    arrival: float | None           # offset from the start (open loop); None in closed loop
    prompt: str
    max_tokens: int
    prompt_tokens_target: int
    disconnect_after: int | None = None   # leave after this many text chunks (0: after headers)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def rng_for(seed: int, stream: str) -> random.Random:
    """An independent, reproducible stream (string seeds hash with SHA-512, not Python's hash)."""
    return random.Random(f"poot:{seed}:{stream}")


def text_of(n_tokens: int, rng: random.Random, chars_per_token: float = 1.0) -> str:
    """Deterministic filler text of about `n_tokens` tokens (exactly n characters at 1.0)."""
    n_chars = max(1, int(round(n_tokens * chars_per_token)))
    out: list[str] = []
    size = 0
    while size <= n_chars:  # joined length is size - 1
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _fit(prompt: int, output: int, cfg: LoadConfig) -> tuple[int, int]:
    """Keeps prompt + output (+ a little room for BOS and templates) inside the context."""
    room = cfg.max_context - 8
    prompt = max(1, min(prompt, room - 1))
    output = max(1, min(output, room - prompt))
    return prompt, output


def build(cfg: LoadConfig) -> list[RequestSpec]:
    """The whole workload of one run, in dispatch order."""
    arrivals_rng = rng_for(cfg.seed, "arrivals")
    lengths_rng = rng_for(cfg.seed, "lengths")
    text_rng = rng_for(cfg.seed, "text")
    leave_rng = rng_for(cfg.seed, "disconnect")
    cpt = cfg.chars_per_token
    specs: list[RequestSpec] = []

    system = ""
    if cfg.shared_prefix:
        system = text_of(cfg.shared_prefix, rng_for(cfg.seed, "system"), cpt) + "\n"

    # Long-output decoders first (burst scenario): they must be streaming when the burst lands.
    for i in range(cfg.decoders):
        p, o = _fit(16, cfg.decoder_output, cfg)
        specs.append(RequestSpec(len(specs), "decode", 0.05 * i if cfg.mode == "open" else None,
                                 text_of(p, text_rng, cpt), o, p))

    n_main = cfg.requests
    times = poisson_arrivals(n_main, cfg.rate, arrivals_rng) if cfg.mode == "open" else [None] * n_main
    for t in times:
        p_len = cfg.prompt.draw(lengths_rng)
        o_len = cfg.output.draw(lengths_rng)
        extra: dict = {}
        if cfg.quote:
            passage_len = max(8, p_len - 40)
            passage = text_of(passage_len, text_rng, cpt)
            prompt = f"Repeat the passage exactly.\nPassage: {passage}\nRepeat: "
            p_len = len(prompt) if cpt == 1.0 else int(len(prompt) / cpt)
            o_len = passage_len
            extra["passage"] = passage
            kind = "quote"
        else:
            q_len = p_len
            prompt = system + text_of(q_len, text_rng, cpt)
            p_len = len(system) + q_len if cpt == 1.0 else cfg.shared_prefix + q_len
            kind = "main"
        p_len, o_len = _fit(p_len, o_len, cfg)
        leave = None
        if cfg.disconnect_share and leave_rng.random() < cfg.disconnect_share:
            leave = leave_rng.randint(0, max(0, o_len // 2))
        specs.append(RequestSpec(len(specs), kind, t, prompt, o_len, p_len, leave, extra))

    for _ in range(cfg.burst):
        p, o = _fit(cfg.burst_prompt, 8, cfg)
        specs.append(RequestSpec(len(specs), "burst", cfg.burst_at if cfg.mode == "open" else None,
                                 text_of(p, text_rng, cpt), o, p))

    if cfg.mode == "open":
        specs.sort(key=lambda s: (s.arrival, s.id))
    return specs


def request_body(spec: RequestSpec, cfg: LoadConfig) -> tuple[str, dict]:
    """(path, JSON body) of the streamed request for one spec."""
    body: dict = {"model": cfg.model or "default", "max_tokens": spec.max_tokens, "stream": True,
                  "temperature": cfg.temperature}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.include_usage:
        body["stream_options"] = {"include_usage": True}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = spec.prompt
    return "/v1/completions", body


# ---------------------------------------------------------------- scenarios
# Defaults sized for the synthetic model (context 512) and a small machine; every knob can be
# overridden on the command line.
SCENARIOS: dict[str, dict] = {
    "poisson": dict(mode="open", rate=4.0, requests=40),
    "closed": dict(mode="closed", concurrency=4, requests=40),
    "lognormal": dict(mode="open", rate=4.0, requests=40,
                      prompt=Lengths("lognormal", 8, 320, 64.0, 0.8),
                      output=Lengths("lognormal", 4, 256, 48.0, 0.9)),
    "shared-prefix": dict(mode="open", rate=4.0, requests=40, shared_prefix=192,
                          prompt=Lengths("uniform", 16, 64), output=Lengths("uniform", 16, 64)),
    "long-burst": dict(mode="open", requests=0, decoders=4, decoder_output=400, burst=6,
                       burst_at=0.5, burst_prompt=440, concurrency=16),
    "disconnect": dict(mode="open", rate=8.0, requests=40, disconnect_share=0.7,
                       output=Lengths("uniform", 64, 256), concurrency=32),
    "quote": dict(mode="open", rate=2.0, requests=16, quote=True, prompt=Lengths("uniform", 120, 220)),
    "smoke": dict(mode="open", rate=6.0, requests=16, shared_prefix=64, disconnect_share=0.25,
                  prompt=Lengths("uniform", 16, 64), output=Lengths("uniform", 8, 64)),
    # 64 users against a server of fewer rows (32 for SmolLM2 on 2 cores) queue by design: the
    # first wave's second half waits a whole generation for a row, and one such request took
    # 33 s to its first token and 60 s in all while streaming a token every 0.25 s. The
    # timeout is there to catch a hung stream, not to judge the machine's speed.
    "soak": dict(mode="closed", concurrency=64, requests=256, cycle=True, disconnect_share=0.25,
                 prompt=Lengths("uniform", 16, 128), output=Lengths("uniform", 16, 128), timeout_s=300.0),
}

DESCRIPTIONS = {
    "poisson": "open loop, Poisson arrivals at --rate, bounded-uniform lengths",
    "closed": "closed loop, --concurrency users each sending the next request when the last ends",
    "lognormal": "open loop, log-normal prompt and output lengths (heavy right tail, bounded)",
    "shared-prefix": "open loop, every prompt starts with the same system prompt (prefix reuse)",
    "long-burst": "long-output streams decoding while a burst of long prompts arrives at once",
    "disconnect": "disconnect storm: most clients leave at a random point; server must end idle",
    "quote": "prompts that ask to repeat a passage they contain (speculative decoding)",
    "smoke": "short mixed run: shared prefix and some disconnects, for CI",
    "soak": "64 closed-loop streams, a quarter hanging up mid-stream, for --run-time; RSS must stay flat",
    "convoy": "static vs dynamic vs continuous client dispatch, same workload (see README)",
}


def scenario_config(name: str, **overrides) -> LoadConfig:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; one of {', '.join(sorted(SCENARIOS))}")
    base = replace(LoadConfig(), scenario=name, **SCENARIOS[name])
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **overrides)
