"""Deliberately broken variants of the reference server, one per clause they must break.

The reference server takes a hidden, test-only `--mutation NAME`. Run against a mutated server,
the suite must fail `breaks`, may also fail the clauses in `also` (the same defect seen from
another angle), and must pass every other clause it runs (`scope`: the id prefixes run for
this mutation; by default the area of `breaks`). tests/conformance/test_mutations.py runs
them all; the table in conformance/README.md is this list.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Mutation:
    name: str
    breaks: str  # the clause id that must fail
    does: str  # what the defect is, in one line
    also: tuple[str, ...] = ()  # clauses that may fail too
    scope: tuple[str, ...] = ()  # clause id prefixes to run; default: the area of `breaks`
    recurrent: bool = False  # needs the server started with a recurrent-state model

    @property
    def prefixes(self) -> tuple[str, ...]:
        return self.scope or (self.breaks.split("/", 1)[0],)


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("ignore_disconnect_nonstream", "cancel/nonstream/1",
             "a non-streaming request whose client hung up runs to its end"),
    Mutation("ignore_disconnect_stream", "cancel/stream/1",
             "a stream whose client hung up runs to its end",
             also=("cancel/prefix/1", "cancel/waiting/1", "cancel/release/1", "cancel/idle/1")),
    Mutation("keep_cancelled_waiting", "cancel/waiting/1",
             "a queued request whose client left stays queued and opens later"),
    Mutation("leak_block_on_cancel", "cancel/release/1",
             "each cancelled request keeps one KV block reserved for good",
             also=("cancel/idle/1", "cancel/waiting/1", "cancel/prefix/1", "cancel/stream/1",
                   "cancel/nonstream/1")),
    Mutation("no_cancel_prefix", "cancel/prefix/1",
             "releasing a cancelled request registers no prefix"),
    Mutation("recompile_on_batch_change", "compile/constant/1",
             "the driver builds a new entry whenever the batch size changes"),
    Mutation("youngest_first", "loop/admission/1",
             "the scheduler opens the youngest waiting request first"),
    Mutation("reserve_prompt_only", "loop/reserve/1",
             "opening a request reserves blocks for its prompt only, not its max_tokens"),
    Mutation("prefill_only_steps", "loop/prefill/1",
             "steps that prefill leave the decoding rows out"),
    Mutation("no_prefill_budget", "loop/prefill/2",
             "every waiting prompt is prefilled whole in one step, whatever the token budget"),
    Mutation("continue_after_eos", "loop/commit/eos/1",
             "end-of-sequence is ignored unless the request hits max_tokens"),
    Mutation("stream_stop_prefix", "loop/commit/stop/2",
             "streams decode tokens at once, sending text held back for a stop string",
             also=("api/stream/1",), scope=("loop/commit/stop", "api/stream")),
    Mutation("off_by_one_max_tokens", "loop/commit/length/1",
             "one token more than max_tokens is produced",
             also=("api/finish/1", "api/usage/1", "api/sse/3", "api/stream/1"),
             scope=("loop/commit/length", "api/usage", "api/finish")),
    Mutation("batch_stream", "loop/commit/stream/1",
             "a stream sends all its text in the final chunk instead of token by token",
             scope=("loop/commit",)),
    Mutation("no_prefix_registration", "prefix/register/1",
             "finished requests register nothing in the prefix cache",
             also=("prefix/reuse/1", "prefix/metrics/1")),
    Mutation("register_recurrent_prefix", "prefix/recurrent/1",
             "a recurrent-state model registers prompt blocks like an attention model",
             scope=("prefix/recurrent",), recurrent=True),
    Mutation("refuse_kills_engine", "faults/refuse/2",
             "a refused step is treated as a fault: the engine dies",
             also=("faults/refuse/1",), scope=("faults/refuse",)),
    Mutation("healthy_when_dead", "faults/dead/1",
             "/health answers 200 ok after the engine died",
             also=("faults/dead/2",), scope=("faults/dead",)),
    Mutation("healthy_while_draining", "drain/health/1",
             "/health answers 200 and new requests are served while draining",
             also=("drain/refuse/1",), scope=("drain",)),
    Mutation("accept_unknown_options", "startup/options/1",
             "unknown command-line options are ignored",
             also=("startup/plan/1",), scope=("startup/options", "startup/plan/1")),
    Mutation("rows_from_env", "startup/plan/2",
             "the POOT_ROWS environment variable sets the plan's rows",
             scope=("startup/plan/2",)),
    Mutation("no_done_sentinel", "api/sse/1",
             "streams end without data: [DONE]",
             also=("api/stream/1", "api/finish/1", "api/sse/3"), scope=("api/sse", "api/stream", "api/finish")),
    Mutation("bad_params_500", "api/errors/2",
             "out-of-range sampling parameters get 500 instead of 400",
             also=("api/errors/3",), scope=("api/errors",)),
    Mutation("no_metrics_steps", "metrics/names/1",
             "/metrics leaves out engine_steps_total",
             scope=("metrics/names",)),
)

BY_NAME = {m.name: m for m in MUTATIONS}
