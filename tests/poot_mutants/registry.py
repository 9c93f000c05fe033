"""Every deliberately broken variant of the reference server, one entry each.

A variant must fail the clause `breaks`, with a reason containing `reason`; it may also fail
the clauses in `also` (the same defect seen from another angle), and must pass every other
clause it runs: its `scope` (clause id prefixes; by default the area of `breaks`) and its
`control`, a clause the defect leaves alone, so a variant that cannot even start fails the
proof instead of proving its clause. `parts` says how it is built: for each part of the
server (engine, scheduler, prefix_cache, stop_checker, random_stream, driver, state,
middleware, parser, key_guard), the subclass or wrapper that replaces the reference one. A
`keyed` variant is started with an API key (and the suite given it), as the bundled run is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import api_parts as a
from . import engine_parts as e
from . import http_parts as h
from . import responses_parts as r
from . import structured_parts as s
from . import tool_parts as t

CONTROL = "api/health/1"


@dataclass(slots=True, frozen=True)
class Mutant:
    name: str
    breaks: str  # the clause id that must fail
    does: str  # what the defect is, in one line
    reason: str  # a substring the failure of `breaks` must contain
    parts: dict = field(default_factory=dict)
    also: tuple[str, ...] = ()  # clauses that may fail too
    scope: tuple[str, ...] = ()  # clause id prefixes to run; default: the area of `breaks`
    control: str = CONTROL  # a clause that must pass: the variant started and serves
    recurrent: bool = False  # needs a recurrent-state model too
    speculative: bool = False  # needs speculative decoding too (--draft ngram)
    keyed: bool = False  # started with an API key, which the suite is given

    @property
    def prefixes(self) -> tuple[str, ...]:
        return (*(self.scope or (self.breaks.split("/", 1)[0],)), self.control)


M = Mutant
MUTANTS: tuple[Mutant, ...] = (
    M("ignore_disconnect_nonstream", "cancel/nonstream/1",
      "a non-streaming request whose client hung up runs to its end", "engine steps passed between the hang-up",
      {"middleware": h.IgnoreDisconnectNonstream}),
    M("ignore_disconnect_stream", "cancel/stream/1",
      "a stream whose client hung up runs to its end", "engine steps passed between the hang-up",
      {"middleware": h.IgnoreDisconnectStream},
      also=("cancel/prefix/1", "cancel/waiting/1", "cancel/release/1", "cancel/idle/1")),
    M("keep_cancelled_waiting", "cancel/waiting/1",
      "a queued request whose client left stays queued and opens later", "queue",
      {"engine": e.KeepCancelledWaiting}),
    M("leak_block_on_cancel", "cancel/release/1",
      "each cancelled request keeps one KV block reserved for good", "blocks given back by no request",
      {"prefix_cache": e.LeakBlockOnCancel},
      also=("cancel/idle/1", "cancel/waiting/1", "cancel/prefix/1", "cancel/stream/1", "cancel/nonstream/1")),
    M("no_cancel_prefix", "cancel/prefix/1",
      "releasing a cancelled request registers no prefix", "prefix_registered_tokens grew by 0",
      {"prefix_cache": e.NoCancelPrefix}),
    M("recompile_on_batch_change", "compile/constant/1",
      "the driver builds a new entry whenever the batch size changes", "as the batch changed",
      {"driver": e.RecompileOnBatchChange}),
    M("youngest_first", "loop/admission/1",
      "the scheduler opens the youngest waiting request first", "expected [0, 1, 2]",
      {"scheduler": e.YoungestFirst}),
    M("reserve_prompt_only", "loop/reserve/1",
      "opening a request reserves blocks for its prompt only, not its max_tokens", "kv_blocks_reserved fell to",
      {"scheduler": e.ReservePromptOnly, "driver": e.FollowsGrownTables}),
    M("prefill_only_steps", "loop/prefill/1",
      "steps that prefill leave the decoding rows out", "some steps left the decoding row out",
      {"scheduler": e.PrefillOnlySteps}, also=("loop/prefill/2",)),
    M("no_prefill_budget", "loop/prefill/2",
      "beside decoding rows, every waiting prompt is prefilled whole in one step, whatever the token budget",
      "fed more than the token budget", {"scheduler": e.NoPrefillBudget, "driver": e.LaxStepCheck}),
    M("no_idle_prefill_budget", "loop/prefill/3",
      "with no row decoding, every waiting prompt is prefilled whole in one step, whatever the idle budget",
      "were prefilled in", {"scheduler": e.NoIdlePrefillBudget, "driver": e.LaxStepCheck}),
    M("continue_after_eos", "loop/commit/eos/1",
      "end-of-sequence is ignored unless the request hits max_tokens", "but the answer ended 'length'",
      {"engine": e.ContinueAfterEos}),
    M("stream_stop_prefix", "loop/commit/stop/2",
      "text that could still become a stop string is released at once", "stop=",
      {"stop_checker": e.ReleaseStopPrefix},
      also=("api/stream/1", "loop/commit/stop/1"), scope=("loop/commit/stop", "api/stream")),
    M("off_by_one_max_tokens", "loop/commit/length/1",
      "one token more than max_tokens is produced", "max_tokens=1: completion_tokens 2",
      {"engine": e.OffByOneMaxTokens},
      also=("api/finish/1", "api/usage/1", "api/sse/3", "api/stream/1"),
      scope=("loop/commit/length", "api/usage", "api/finish")),
    M("batch_stream", "loop/commit/stream/1",
      "a stream sends all its text in the final chunk instead of token by token", "content chunks",
      {"middleware": h.BatchStream}, scope=("loop/commit",)),
    M("no_prefix_registration", "prefix/register/1",
      "finished requests register nothing in the prefix cache", "grew prefix_registered_tokens by 0",
      {"prefix_cache": e.NoPrefixRegistration}, also=("prefix/reuse/1", "prefix/metrics/1")),
    M("register_recurrent_prefix", "prefix/recurrent/1",
      "a recurrent-state model registers prompt blocks like an attention model", "a recurrent model registered",
      {"prefix_cache": e.RegisterRecurrentPrefix}, scope=("prefix/recurrent",), recurrent=True),
    M("refuse_kills_engine", "faults/refuse/2",
      "a refused step is treated as a fault: the engine dies", "after a refused step /health answered",
      {"engine": e.RefuseKillsEngine}, also=("faults/refuse/1",), scope=("faults/refuse",)),
    M("healthy_when_dead", "faults/dead/1",
      "/health answers 200 ok after the engine died", "/health answered 200",
      {"middleware": h.HealthyWhenDead}, also=("faults/dead/2",), scope=("faults/dead",)),
    M("die_frees_blocks", "faults/dead/4",
      "a fault releases every running request's row and blocks", "a half-applied step released what",
      {"engine": e.DieFreesBlocks}, scope=("faults/dead",)),
    M("healthy_while_draining", "drain/health/1",
      "/health answers 200 and new requests are served while draining", "while draining /health answered 200",
      {"middleware": h.HealthyWhileDraining, "state": h.ServeWhileDraining},
      also=("drain/refuse/1",), scope=("drain",)),
    M("accept_unknown_options", "startup/options/1",
      "unknown command-line options are ignored", "an unknown option did not fail startup",
      {"parser": h.AcceptUnknownOptions},
      also=("startup/plan/1",), scope=("startup/options", "startup/plan/1")),
    M("rows_from_env", "startup/plan/2",
      "the POOT_ROWS environment variable sets the plan's rows", "plan.rows is 3",
      {"driver": e.RowsFromEnv}, scope=("startup/plan/2",)),
    M("no_done_sentinel", "api/sse/1",
      "streams end without data: [DONE]", "did not end with 'data: [DONE]'",
      {"middleware": h.NoDoneSentinel},
      also=("api/stream/1", "api/finish/1", "api/sse/3"), scope=("api/sse", "api/stream", "api/finish")),
    M("bad_params_500", "api/errors/2",
      "out-of-range sampling parameters get 500 instead of 400", "-> 500",
      {"middleware": h.BadParams500}, also=("api/errors/3", "api/errors/4"), scope=("api/errors",)),
    M("no_metrics_steps", "metrics/names/1",
      "/metrics leaves out engine_steps_total", "lacks engine_steps_total",
      {"engine": e.NoMetricsSteps}, scope=("metrics/names",)),
    M("health_status_ready", "api/health/1",
      '/health answers status "ready" instead of "ok"', "expected 'ok'",
      {"middleware": h.HealthStatusReady}, scope=("api/health",), control="api/models/1"),
    M("models_not_a_list", "api/models/1",
      '/v1/models answers object "models" instead of "list"', "expected 'list'",
      {"middleware": h.ModelsNotAList}, scope=("api/models",)),
    M("completion_no_created", "api/completions/1",
      "completion answers leave out created", "created is None",
      {"middleware": h.CompletionNoCreated}, scope=("api/completions",)),
    M("chat_no_role", "api/chat/1",
      "chat answers' message has no role", "message role is None",
      {"middleware": h.ChatNoRole}, scope=("api/chat",)),
    M("chunk_ids_differ", "api/sse/2",
      "every chunk of a stream gets its own id", "expected one",
      {"middleware": h.ChunkIdsDiffer}, scope=("api/sse",)),
    M("ignore_include_usage", "api/sse/3",
      "stream_options.include_usage is ignored: no usage chunk", "the last chunk carries no usage",
      {"middleware": h.IgnoreIncludeUsage}, scope=("api/sse",)),
    M("stream_drops_first_text", "api/stream/1",
      "a stream leaves out the text of its first token", "!= non-streamed",
      {"middleware": h.StreamDropsFirstText}, scope=("api/stream",)),
    M("stop_reported_as_length", "api/finish/1",
      "requests ended by a stop string or end-of-sequence report finish_reason length", "finish 'length'",
      {"middleware": h.StopReportedAsLength}, scope=("api/finish",)),
    M("total_without_prompt", "api/usage/1",
      "usage.total_tokens leaves out the prompt tokens", "total != sum",
      {"middleware": h.TotalWithoutPrompt}, scope=("api/usage",)),
    M("non_object_body_500", "api/errors/1",
      "a JSON body that is not an object gets 500 instead of 400", "answered 500, expected 400",
      {"middleware": h.NonObjectBody500}, scope=("api/errors",)),
    M("error_param_null", "api/errors/3",
      "400 errors leave param null", "param None",
      {"middleware": h.ErrorParamNull}, scope=("api/errors",)),
    M("unknown_path_400", "api/errors/5",
      "unknown paths get 400 instead of 404", "400 == 404",
      {"middleware": h.UnknownPath400}, scope=("api/errors",)),
    M("no_token_prompts", "api/prompt/1",
      "a prompt given as token ids gets 400", "answered 400",
      {"middleware": h.NoTokenPrompts}, scope=("api/prompt",)),
    M("serve_while_draining", "drain/refuse/1",
      "new requests are served while draining (/health still says draining)", "answered 200, expected 503",
      {"state": h.ServeWhileDraining}),
    M("drain_exit_1", "drain/exit/1",
      "the process exits 1 once drained", "exited with 1",
      {"state": h.DrainExit1}),
    M("exit_at_sigterm", "drain/health/1",
      "the process exits 1 at SIGTERM, cutting its streams off, instead of draining",
      "/health got no answer after the shutdown signal", {"state": h.ExitAtSigterm},
      also=("drain/inflight/1", "drain/exit/1"), scope=("drain",)),
    M("drain_cancels_inflight", "drain/inflight/1",
      "shutdown cancels the requests in flight instead of letting them finish", "the stream in flight at shutdown",
      {"engine": e.CancelAllOnDrain, "state": h.CancelOnDrain}, also=("drain/health/1",)),
    M("panic_reported_as_fault", "faults/dead/2",
      "/health reports cause fault for a panicked engine thread", "expected 'panicked'",
      {"middleware": h.PanicReportedAsFault}, scope=("faults/dead",)),
    M("dead_plain_503", "faults/dead/3",
      "a request to a dead engine gets a plain-text 503 with no error object", "no error object",
      {"middleware": h.DeadPlain503}, scope=("faults/dead",)),
    M("count_stop_as_length", "metrics/counters/1",
      "requests_finished_total counts stop as length", "moved by 0",
      {"engine": e.CountStopAsLength}, scope=("metrics",)),
    M("rows_gauge_off_by_one", "metrics/kv/1",
      "engine_rows reports one row more than the plan", "!= plan rows",
      {"engine": e.RowsGaugeOffByOne}, scope=("metrics",)),
    M("in_use_counts_cached", "metrics/idle/1",
      "kv_blocks_in_use counts cached blocks too, so an idle server reads non-zero", "idle server reports",
      {"engine": e.InUseCountsCached}, also=("metrics/kv/1",), scope=("metrics",)),
    M("hit_rate_percent", "prefix/metrics/1",
      "prefix_cache_hit_rate is exported as a percentage", "outside [0, 1]",
      {"engine": e.HitRatePercent}, scope=("prefix",)),
    M("spec_counters_swapped", "speculative/metrics/1",
      "spec_drafted_tokens_total and spec_accepted_tokens_total are swapped", "drafted tokens",
      {"engine": e.SpecCountersSwapped}, scope=("speculative",), speculative=True),
    M("rows_option", "startup/plan/1",
      "poot-serve accepts a --max-num-seqs option", "--max-num-seqs",
      {"parser": h.RowsOption}, scope=("startup",)),
    M("shared_position", "determinism/batch/1",
      "every token of a step gets one shared position", "under load",
      {"driver": e.SharedPosition}, scope=("determinism/batch",)),
    M("batch_dependent_precision", "determinism/batch/1",
      "steps of more than one row keep 3 bits of their logits' mantissa", "under load",
      {"driver": e.BatchDependentPrecision}, scope=("determinism/batch",)),
    M("no_prefix_reuse", "prefix/reuse/1",
      "prefix lookups never hit", "hit 0 cached tokens",
      {"prefix_cache": e.NoPrefixReuse}, scope=("prefix",)),
    M("ignore_seed", "determinism/seed/1",
      "sampling ignores the request's seed", "same seed, different texts",
      {"random_stream": e.ignore_seed}, scope=("determinism",)),
    M("keep_stop_string", "loop/commit/stop/1",
      "a request ended by a stop string still outputs the stop string", "contains the stop string",
      {"stop_checker": e.KeepStopString}, also=("loop/commit/stop/2",), scope=("loop/commit/stop",)),
    M("clamp_max_tokens", "api/errors/4",
      "a request that can never fit is cut to fit instead of refused", "expected 400",
      {"engine": e.ClampMaxTokens}, scope=("api/errors",)),
    M("accept_all_drafts", "speculative/greedy/1",
      "verification keeps going past a rejected draft token", "with drafting",
      {"engine": e.AcceptAllDrafts}, scope=("speculative",), speculative=True),
    M("refuse_fails_waiting", "faults/refuse/1",
      "a refused step also fails every waiting request", "the queued request, not part of the refused step",
      {"engine": e.RefuseFailsWaiting}, scope=("faults/refuse",)),
    M("one_row_per_step", "loop/batching/1",
      "each step decodes one row only: rows take turns instead of sharing steps", "batched they need about",
      {"scheduler": e.OneRowPerStep}, scope=("loop/batching",)),
    M("refuse_when_full", "loop/admission/2",
      "a request that finds every row taken is refused instead of queued", "waiting",
      {"engine": e.RefuseWhenFull}, also=("loop/preempt/1",), scope=("loop/admission/2", "loop/preempt")),
    M("preempt_youngest", "loop/preempt/1",
      "a request kept waiting takes the row of the youngest running request, which fails", "a running request lost its row",
      {"engine": e.PreemptYoungest}, scope=("loop/admission/2", "loop/preempt")),
    M("stop_keeps_row", "cancel/idle/1",
      "a request ended by a stop string keeps its row and blocks", "the server still holds",
      {"scheduler": e.StopKeepsRow}, scope=("cancel/idle",)),
    M("prefix_hit_refeeds_prompt", "determinism/prefix/1",
      "after a prefix-cache hit, the prompt is fed again from its start at the positions after the cached blocks",
      "!= warm", {"scheduler": e.PrefixHitRefeedsPrompt},
      also=("determinism/batch/1", "determinism/seed/1"), scope=("determinism",)),
    M("ignore_eos_ignored", "api/ignore-eos/1",
      "ignore_eos is dropped from the request", "ignore_eos must go on past end-of-sequence",
      {"middleware": a.ignore_eos_ignored}, scope=("api/ignore-eos",), control="api/completions/1"),
    # A crash: the clause during which the server stopped serving is "crashed" and names the
    # request; api/errors/3 sends the same table, so a fresh server dies on it too.
    M("empty_prompt_kills_engine", "api/errors/2",
      "a completion without a prompt (read as empty) kills the engine for good: 500, then 503 for everything",
      "the server stopped serving during this clause (/health answered 503",
      {"middleware": h.EmptyPromptKillsEngine}, also=("api/errors/3",), scope=("api/errors",)),
    M("empty_prompt_exits", "api/errors/2",
      "a completion without a prompt (read as empty) makes the process exit",
      "the server stopped serving during this clause (its process exited with status 1",
      {"middleware": h.EmptyPromptExitsProcess}, also=("api/errors/3",), scope=("api/errors",)),
    M("any_bearer_key", "api/auth/1",
      "a keyed server takes any bearer token, not only its key", "with a wrong key answered 200, expected 401",
      {"key_guard": h.AnyBearerKey}, scope=("api/auth",), keyed=True),
)

# The sampling API: rewrites around the app, run on the sampling clauses with a completion as control.
SAMPLING = ("api/logprobs", "api/echo", "api/n", "api/penalties")
MUTANTS += tuple(M(name, breaks, does, reason, {"middleware": part}, also=also, scope=SAMPLING,
                   control="api/completions/1") for name, breaks, does, reason, part, also in (
    ("logprobs_not_of_the_pick", "api/logprobs/2", "completion logprobs are 0.5 below the picked token's",
     "but its best alternative has", a.logprobs_not_of_the_pick, ()),
    ("logprobs_no_text_offset", "api/logprobs/1", "completion logprobs lack text_offset",
     "text_offset is None", a.logprobs_no_text_offset, ("api/echo/1",)),
    ("chat_logprobs_no_bytes", "api/logprobs/3", "chat logprobs entries lack bytes",
     "bytes is None", a.chat_logprobs_no_bytes, ()),
    ("chat_stream_drops_logprobs", "api/logprobs/4", "streamed chat chunks carry no logprobs",
     "differ from the whole answer's", a.chat_stream_drops_logprobs, ()),
    ("echo_ignored", "api/echo/1", "echo is dropped from the request",
     "expected the prompt then", a.echo_ignored, ()),
    ("echo_scores_first_token", "api/echo/2", "the first prompt token gets logprob 0 instead of null",
     "expected null", a.echo_scores_first_token, ("api/echo/1", "api/logprobs/1")),
    ("n_answers_one_choice", "api/n/1", "a request for n choices answers only the first",
     "choice indices [0]", a.n_answers_one_choice, ("api/n/2",)),
    ("n_stream_one_index", "api/n/2", "every streamed choice comes under index 0",
     "streamed choice indices [0]", a.n_stream_one_index, ()),
    # Each request is sent with the whole request's seed, so its choices also repeat one draw.
    ("n_prefills_each_choice", "api/n/3", "n choices run as n concurrent requests, each prefilling the prompt",
     "the prompt was prefilled more than once", a.n_prefills_each_choice, ("api/n/1", "api/n/2")),
    ("frequency_penalty_ignored", "api/penalties/1", "frequency_penalty is dropped from the request",
     "left the forced repetition", a.frequency_penalty_ignored, ()),
    ("logit_bias_ignored", "api/penalties/2", "logit_bias is dropped from the request",
     "not one token repeated", a.logit_bias_ignored, ("api/penalties/1", "api/penalties/3")),
    ("stop_token_ids_ignored", "api/penalties/3", "stop_token_ids is dropped from the request",
     "expected 'stop'", a.stop_token_ids_ignored, ()),
))

# Structured outputs and unknown fields: rewrites around the app (and one ServerState), and the
# engine's parts that schedule constrained decoding.
STRUCTURED = ("structured",)
MUTANTS += (
    M("response_format_dropped", "structured/json-schema/1",
      "response_format is dropped from the request", "content is not JSON",
      {"middleware": s.response_format_dropped},
      also=("structured/json-schema/2", "structured/json-object/1", "structured/completions/1",
            "structured/invalid/1"), scope=STRUCTURED, control="api/completions/1"),
    # A stream with a schema it cannot serve is taken as text too.
    M("stream_unconstrained", "structured/json-schema/2",
      "streamed requests are not held to their response_format", "content is not JSON",
      {"middleware": s.stream_unconstrained}, also=("structured/invalid/1",), scope=STRUCTURED,
      control="api/completions/1"),
    M("completion_format_dropped", "structured/completions/1",
      "response_format is dropped from completions (chat keeps it)", "content is not JSON",
      {"middleware": s.completion_format_dropped}, scope=STRUCTURED, control="api/completions/1"),
    M("json_object_dropped", "structured/json-object/1",
      "response_format json_object is dropped from the request", "content is not JSON",
      {"middleware": s.json_object_dropped}, scope=STRUCTURED, control="api/completions/1"),
    M("truncated_reported_stop", "structured/length/1",
      "a constrained answer cut at max_tokens reports finish_reason stop", "is not a whole document",
      {"middleware": s.truncated_reported_stop}, scope=STRUCTURED, control="api/completions/1"),
    M("schema_error_500", "structured/invalid/1",
      "a schema that cannot be compiled gets 500 instead of a 4xx", "answered 500, expected a 4xx",
      {"state": s.SchemaError500}, scope=STRUCTURED),
    # Constrained decoding scheduled badly: each seen by timing alone, or on the compile count.
    M("compile_on_engine_thread", "structured/gap/1",
      "a request's grammar is compiled, and its matchers started, on the engine thread as the loop takes it",
      "a running stream waited", {"state": s.CompiledByTheEngine, "engine": s.CompileOnEngineThread},
      scope=STRUCTURED, control="api/completions/1"),
    M("recompile_on_pick_change", "structured/compile/1",
      "the driver builds a new entry whenever a step's rows change between all picked on the device and some "
      "masked on the host", "as constrained rows joined and left", {"driver": s.RecompileOnPickChange},
      scope=STRUCTURED, control="api/completions/1"),
    M("one_constrained_at_a_time", "structured/batch/1",
      "a request with a grammar is opened only while no other one runs: the others wait in the queue",
      "had not been sent a token yet", {"scheduler": s.OneConstrainedAtATime}, scope=STRUCTURED,
      control="api/completions/1"),
    M("unknown_fields_dropped", "api/fields/1",
      "fields the server does not implement are dropped from the request instead of refused",
      "answered 200, the field silently dropped",
      {"middleware": s.unknown_fields_dropped}, scope=("api/fields",), control="api/completions/1"),
)

# Function tools: rewrites around the app, run on the tools clauses with a plain chat as control.
TOOLS = ("tools",)
MUTANTS += tuple(M(name, breaks, does, reason, {"middleware": part}, also=also, scope=TOOLS,
                   control="api/chat/1") for name, breaks, does, reason, part, also in (
    ("tool_arguments_as_object", "tools/required/1", "a call's function.arguments is sent as a JSON object",
     "function.arguments is a dict, not a JSON string", t.tool_arguments_as_object, ("tools/named/1",)),
    ("tool_calls_finish_stop", "tools/required/1", 'an answer of tool calls reports finish_reason "stop"',
     "finish_reason is 'stop', expected 'tool_calls'", t.tool_calls_finish_stop,
     ("tools/named/1", "tools/stream/1")),
    ("named_choice_swapped", "tools/named/1", "a named tool_choice is served as the choice of another of the tools",
     "but tool_choice named 'clock'", t.named_choice_swapped, ()),
    ("stream_call_without_id", "tools/stream/1", "streamed tool_calls deltas carry no id",
     "the first delta of call 0 has no id", t.stream_call_without_id, ()),
    ("stream_pieces_without_index", "tools/stream/1", "streamed arguments pieces carry no index",
     "a tool_calls delta entry has no index", t.stream_pieces_without_index, ()),
    ("parallel_calls_ignored", "tools/parallel/1", "parallel_tool_calls false is ignored: the answer makes a second call",
     "2 tool calls, expected one", t.parallel_calls_ignored, ()),
    ("tool_messages_refused", "tools/result/1", "a conversation holding a tool message is refused with 400",
     "answered 400", t.tool_messages_refused, ()),
    ("unknown_tool_choice_dropped", "tools/invalid/1",
     "a tool_choice naming a function not among the tools is dropped instead of refused",
     "answered 200, expected a 4xx", t.unknown_tool_choice_dropped, ()),
    ("auto_text_reported_tool_calls", "tools/auto/1", 'a text answer under tool_choice "auto" reports finish_reason '
     '"tool_calls"', "but the message holds no tool_calls", t.auto_text_reported_tool_calls, ()),
))

# Not a defect of any clause: a variant that cannot start, for the test that shows such a
# variant fails the proof instead of passing it.
CRASH_AT_START = M("crash_at_start", "api/models/1", "the engine cannot be built", "expected 'list'",
                   {"engine": e.CrashAtStart}, scope=("api/models",))

# Not a defect either: a server that honestly refuses logprobs and echo with a 400, for the test
# that shows such a server is "not supported" on those clauses, never failed.
REFUSES_LOGPROBS = M("refuses_logprobs", "api/logprobs/1", "logprobs and echo are refused with 400", "-",
                     {"middleware": a.refuses_logprobs}, scope=SAMPLING, control="api/completions/1")

# Not a defect either: a server without structured outputs that refuses response_format with a
# 400 naming it, for the test that shows the structured clauses are then "not supported".
REFUSES_RESPONSE_FORMAT = M("refuses_response_format", "structured/json-schema/1",
                            "response_format is refused with 400 naming it", "-",
                            {"middleware": s.refuses_response_format}, scope=(*STRUCTURED, "api/fields"),
                            control="api/completions/1")

# Not defects either: a server that refuses every field outside OpenAI's API with a 422 naming
# it (extensions such as ignore_eos and stop_token_ids included, and response_format on
# /v1/completions, which OpenAI's legacy endpoint lacks), as servers built on a strict request
# model do, for the test that shows the clauses about an extension are then "not supported" and
# no other clause depends on one; and one with 200 rows and no plan on /health, for the test
# that shows its rows are measured.
REFUSES_UNKNOWN_FIELDS = M("refuses_unknown_fields", "api/penalties/3",
                           "fields outside OpenAI's API are refused with 422 naming them", "-",
                           {"middleware": a.refuses_unknown_fields},
                           scope=("api/penalties", "api/ignore-eos", "api/fields", *STRUCTURED, "loop/commit/length",
                                  "loop/admission/1", "drain/inflight"), control="api/completions/1")
ROWS_200_UNPUBLISHED = M("rows_200_unpublished", "loop/admission/1",
                         "the plan fits 200 rows and /health publishes no plan", "-",
                         {"driver": e.TwoHundredRows, "middleware": h.NoPlanOnHealth},
                         scope=("loop/admission", "loop/preempt", "cancel/waiting", "compile/constant"))

# Not a defect either: a server without function tools that refuses them with a 400 naming the
# field, for the test that shows the tools clauses are then "not supported".
REFUSES_TOOLS = M("refuses_tools", "tools/required/1", "tools, tool_choice and parallel_tool_calls are refused with "
                  "400 naming the field", "-", {"middleware": t.refuses_tools}, scope=TOOLS, control="api/chat/1")

BY_NAME = {m.name: m for m in (*MUTANTS, CRASH_AT_START, REFUSES_LOGPROBS, REFUSES_RESPONSE_FORMAT,
                               REFUSES_UNKNOWN_FIELDS, ROWS_200_UNPUBLISHED, REFUSES_TOOLS)}
PARTS = ("engine", "scheduler", "prefix_cache", "stop_checker", "random_stream", "driver", "state", "middleware",
         "parser", "key_guard")


def overrides_nothing_missing(part) -> list[str]:
    """The methods a variant class defines that its reference base lacks: a hook renamed in the
    reference would leave the variant's copy uncalled, a variant quietly as good as the
    reference. Names a variant adds on purpose are listed in its `adds`."""
    if not isinstance(part, type):
        return []
    base = part.__mro__[1:]
    adds = set(getattr(part, "adds", ()))
    return [f"{part.__name__}.{name}" for name, value in vars(part).items()
            if callable(value) or isinstance(value, classmethod | staticmethod | property)
            if not name.startswith("__") and name not in adds and not any(name in vars(b) for b in base)]


def check_overrides() -> None:
    missing = sorted({m for mutant in BY_NAME.values() for part in mutant.parts.values()
                      for m in overrides_nothing_missing(part)})
    if missing:
        raise ImportError(f"variants override what the reference server no longer has: {', '.join(missing)}")


check_overrides()


# OpenAI's Responses API: edits of /v1/responses around the app (and the stream of
# cancel/stream/1's defect), run on the responses clauses with a plain chat as control.
RESPONSES = ("responses",)
RESPONSES_MUTANTS = tuple(M(name, breaks, does, reason, {"middleware": part}, also=also, scope=RESPONSES,
                            control="api/chat/1") for name, breaks, does, reason, part, also in (
    ("response_total_without_input", "responses/object/1", "a response's usage.total_tokens leaves out the input "
     "tokens", "!= input_tokens", r.TotalWithoutInput, ()),
    ("response_sequence_doubled", "responses/stream/1", "each streamed event's sequence_number is twice its place, "
     "skipping every other number", "has sequence_number 2, expected 1", r.SequenceNumbersDoubled, ()),
    ("response_stream_drops_a_delta", "responses/stream/1", "a streamed response leaves out its first output_text "
     "delta", "!= output_text.done's text", r.StreamDropsADelta, ()),
    ("response_stream_item_id_changes", "responses/stream/1", "output_text deltas after the first carry an item_id "
     "of their own", "but the message opened as", r.StreamItemIdChanges, ()),
    ("incomplete_reported_completed", "responses/incomplete/1", 'a response cut by max_output_tokens says status '
     '"completed"', "status 'completed', expected 'incomplete'", r.IncompleteReportedCompleted, ()),
    ("output_tokens_off_by_one", "responses/usage/1", "usage.output_tokens counts one token more than were written",
     "usage.output_tokens is 17, expected 16", r.OutputTokensOffByOne, ()),
    ("instructions_dropped", "responses/instructions/1", "instructions are dropped from the request",
     "the instructions were not put before the input", r.InstructionsDropped, ()),
    ("previous_response_ignored", "responses/previous/1", "the previous_response_id of a stored response is "
     "dropped: the conversation starts anew", "no more than the new input alone", r.PreviousResponseIgnored,
     ("responses/tools/2",)),
    ("unknown_previous_answered", "responses/previous/2", "an unknown previous_response_id is dropped instead of "
     "refused", "answered 200, expected a 4xx", r.UnknownPreviousAnswered, ()),
    ("call_arguments_as_object", "responses/tools/1", "a function_call item's arguments are sent as a JSON object",
     "arguments is a dict, not a JSON string", r.CallArgumentsAsObject,
     ("responses/tools/2",)),
    ("call_output_refused", "responses/tools/2", "an input holding a function_call_output item is refused with 400",
     "answered 400", r.CallOutputRefused, ()),
    ("text_format_dropped", "responses/json-schema/1", "text.format is dropped from the request", "is not JSON",
     r.TextFormatDropped, ()),
    ("response_stream_ignores_disconnect", "responses/cancel/1", "a streamed response whose client hung up runs to "
     "its end", "engine steps passed between the hang-up", h.IgnoreDisconnectStream, ()),
    ("responses_bad_input_500", "responses/invalid/1", "a response request refused for its input or "
     "max_output_tokens gets 500 instead of 400", "answered 500, expected a 4xx", r.BadInput500, ()),
))
MUTANTS += RESPONSES_MUTANTS

# Not a defect: a server without the Responses API, whose /v1/responses answers 404, for the
# test that shows every responses clause is then "not supported".
NO_RESPONSES_ENDPOINT = M("no_responses_endpoint", "responses/object/1", "/v1/responses answers 404", "-",
                          {"middleware": r.NoResponsesEndpoint}, scope=RESPONSES, control="api/chat/1")
BY_NAME.update({m.name: m for m in (*RESPONSES_MUTANTS, NO_RESPONSES_ENDPOINT)})
check_overrides()
