"""The engine plan: rows, positions, KV blocks and the per-step token budget, fitted to the
device the driver reports and to the model's sizes.

Nothing outside this function chooses these numbers: there is no option or environment
variable for them, so one device and one model always give one plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True, frozen=True)
class DeviceInfo:
    backend: str  # numpy, ptx, rocm, wgpu, vulkan
    name: str
    memory_bytes: int  # memory the driver may use for weights, KV and activations
    parallel_rows: int  # rows the device can step at little more than the cost of one
    # FLOPs the device does in the time it streams one byte (its GEMM rate over its memory
    # bandwidth): below this many FLOPs per weight byte a step is bound by reading weights.
    flops_per_byte: float = 11.0
    # The driver's products run on a multiple of this many tokens (MKL's are zero-padded to
    # it): a budget rounded up to it computes its extra tokens at no extra cost.
    token_multiple: int = 1
    # The most bytes one buffer binding may hold (a WebGPU adapter's limit; 0: no limit).
    max_binding_bytes: int = 0
    adapter: str = ""  # the adapter a GPU driver chose, as it describes itself
    isa: str = ""  # the instruction set the driver's compiled code runs on (CPU: avx512-vnni, avx2, ...)


@dataclass(slots=True, frozen=True)
class Plan:
    backend: str
    rows: int
    positions: int  # most tokens (prompt + max_tokens) one sequence may hold
    block_size: int
    num_blocks: int
    token_budget: int  # tokens one step may compute, decode tokens and prefill chunks together
    model: str = ""
    state_slots: int = 0  # recurrent families: one state slot per row instead of KV blocks
    # Tokens a step with no decoding row may compute: nobody's stream waits on it, so its
    # chunk may be long enough for the products to run at their full rate. 0: token_budget.
    idle_token_budget: int = 0
    adapter: str = ""  # the device adapter the driver runs on, where it chose one
    isa: str = ""  # the instruction set its compiled code runs on, where the driver names one
    # Prefill tokens a step beside only a few decoding rows may add (see step_budget): about
    # one read of the weights' worth of arithmetic (weight_read_tokens). 0: no cap but
    # token_budget. Published (as_dict, GET /health) under its old name, prefill_chunk.
    prefill_beside_decoding: int = 0
    token_multiple: int = 1  # the device's products run on multiples of this many tokens
    # What runs each weight product, where the driver chose it by measurement when preparing
    # (the CPU driver: per shape, the path for each range of token counts).
    products: tuple[str, ...] = ()
    # Where that choice came from: "measured" by this start; "preferred" by this start
    # without timing, the machine too busy to tell (each product on its first path); or
    # "cached" (read from what an earlier start on this machine made under the same
    # conditions); and when it was made (UTC, ISO 8601). Empty where nothing was measured.
    products_chosen: str = ""
    products_measured_at: str = ""

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefill_budget(self, decoding: bool) -> int:
        """The tokens one step may feed: token_budget while any row is decoding, else the
        idle budget."""
        return self.token_budget if decoding else max(self.token_budget, self.idle_token_budget)

    def step_budget(self, decoding_rows: int) -> int:
        """The tokens one step may feed beside `decoding_rows` decoding rows (their own tokens
        included): the idle budget when none decodes; else at most token_budget, and at most
        2D + P, P being prefill_beside_decoding. A step reads the weights once, which costs
        about P tokens' arithmetic, and then computes each token it feeds, so its cost goes
        as P + T: at 2D + P tokens a step costs about twice what the D decoding rows' own
        step would, however few they are. On a device whose products are
        padded to a width the cap rounds down to it (a step over a width costs the next
        whole width), but never to D or below."""
        if decoding_rows == 0:
            return self.max_step_tokens
        if not self.prefill_beside_decoding:
            return self.token_budget
        d, m = decoding_rows, max(1, self.token_multiple)
        cap = 2 * d + self.prefill_beside_decoding
        rounded = (cap // m) * m
        return min(self.token_budget, rounded if rounded > d else cap)

    @property
    def max_step_tokens(self) -> int:
        return self.prefill_budget(decoding=False)

    def as_dict(self) -> dict:
        """The plan as GET /health publishes it: every field, prefill_beside_decoding under
        its published name, prefill_chunk, in the same place."""
        return {PUBLISHED_AS.get(k, k): v for k, v in asdict(self).items()}


PUBLISHED_AS = {"prefill_beside_decoding": "prefill_chunk"}  # public names kept stable across renames


BLOCK_SIZE = 16
MAX_POSITIONS = 2048
KV_SHARE = 0.2  # share of device memory the KV pool may take, after the weights
PREFILL_SHARE = 1.0  # a prefill chunk beside few decoding rows: about one weight read of arithmetic
IDLE_PREFILL_SHARE = 8.0  # likewise, a step that no decoding row waits on


def weight_read_tokens(device: DeviceInfo, itemsize: int = 4) -> int:
    """Tokens whose arithmetic takes about as long as reading the weights once (at least
    16): the prefill a step beside a few decoding rows may carry (Plan.prefill_beside_decoding).

    A token costs 2 FLOPs per weight (itemsize bytes), so at `balance` tokens a step's
    arithmetic takes as long as reading the weights once, which is what a step of a few
    decoding rows costs: a chunk of that size about doubles such a step, so decoding rows
    never stall behind a burst of long prompts, and the prompts still advance every step.
    """
    balance = device.flops_per_byte * itemsize / 2
    return max(16, int(PREFILL_SHARE * balance))


def idle_prefill_chunk(device: DeviceInfo, itemsize: int = 4) -> int:
    """Prefill tokens a step may carry when no row is decoding.

    With nobody's next token waiting on the step, the chunk is sized for the products: at
    eight weight reads' worth of arithmetic, reading the weights is an eighth of a step, and
    a longer chunk gains little (measured on SmolLM2 on two cores: 80 to 176 tokens per step
    made a 512-token prefill 1.2x faster, 176 to 512 nothing) while a request that arrives
    meanwhile waits longer to be admitted.
    """
    balance = device.flops_per_byte * itemsize / 2
    return max(weight_read_tokens(device, itemsize), int(IDLE_PREFILL_SHARE * balance))


def fit_plan(device: DeviceInfo, config, weight_bytes: int, model_name: str = "",
             kv_bytes_per_token: int | None = None) -> Plan:
    """Fits the plan; raises ValueError when the model cannot be served on the device at all.
    `kv_bytes_per_token` is the driver's (its KV layout and dtype); float32 when not given.
    A device that binds at most `max_binding_bytes` in one buffer holds each layer's KV in
    one binding, so the pool is capped there too."""
    positions = min(int(config.max_positions), MAX_POSITIONS)
    rows = max(1, device.parallel_rows)
    multiple = max(1, device.token_multiple)
    beside = weight_read_tokens(device)
    # Every row decoding, a step may cost twice their own step (Plan.step_budget).
    token_budget = max(rows + 1, (2 * rows + beside) // multiple * multiple)
    idle_budget = max(token_budget, -(-idle_prefill_chunk(device) // multiple) * multiple)
    if getattr(config, "recurrent", False):
        return Plan(device.backend, rows, positions, BLOCK_SIZE, 0, token_budget, model_name, state_slots=rows,
                    idle_token_budget=idle_budget, adapter=device.adapter, isa=device.isa, prefill_beside_decoding=beside,
                    token_multiple=multiple)
    free = device.memory_bytes - weight_bytes
    if free <= 0:
        raise ValueError(f"the model's weights ({weight_bytes} bytes) do not fit the device ({device.memory_bytes} bytes)")
    per_token = kv_bytes_per_token if kv_bytes_per_token is not None else config.kv_bytes_per_token()
    block_bytes = BLOCK_SIZE * per_token
    affordable = int(free * KV_SHARE) // block_bytes
    if device.max_binding_bytes:  # one layer's KV (K and V) must fit one binding
        affordable = min(affordable, device.max_binding_bytes * config.num_layers // block_bytes)
    # No more blocks than every row at full length could use.
    needed = rows * -(-positions // BLOCK_SIZE)
    num_blocks = min(affordable, needed)
    if num_blocks * BLOCK_SIZE < positions:
        # Shrink positions rather than refuse: one sequence must always fit on its own.
        positions = num_blocks * BLOCK_SIZE
    if positions < BLOCK_SIZE:
        raise ValueError("the device has no room for a KV cache")
    return Plan(device.backend, rows, positions, BLOCK_SIZE, num_blocks, token_budget, model_name,
                idle_token_budget=idle_budget, adapter=device.adapter, isa=device.isa, prefill_beside_decoding=beside,
                token_multiple=multiple)
