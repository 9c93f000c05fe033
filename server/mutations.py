"""Deliberate defects, switched on by the hidden `--mutation NAME` option (repeatable).

They exist only so the conformance suite can prove that each of its checks can fail (see
conformance/mutations.py): a server started with a mutation must fail the clause guarding
the behaviour it breaks. Server-level names are handled in server/; engine-level names go
to `Engine.create(mutations=...)`. A name neither side knows fails start-up, so a mutation
run never passes silently against a server that ignored its defect.
"""

from __future__ import annotations

SERVER_MUTATIONS = {
    "ignore_disconnect_nonstream": "a non-streaming request whose client hung up runs to its end",
    "ignore_disconnect_stream": "a stream whose client hung up runs to its end",
    "healthy_while_draining": "/health answers 200 and new requests are served while draining",
    "healthy_when_dead": "/health answers 200 ok after the engine died",
    "stream_stop_prefix": "streams decode tokens at once, sending text held back for a stop string",
    "batch_stream": "a stream sends all its text in the final chunk instead of token by token",
    "no_done_sentinel": "streams end without data: [DONE]",
    "bad_params_500": "out-of-range sampling parameters get 500 instead of 400",
    "no_metrics_steps": "/metrics leaves out engine_steps_total",
    "accept_unknown_options": "unknown command-line options are ignored",
    "rows_from_env": "the POOT_ROWS environment variable sets the plan's rows",
    "health_status_ready": "/health answers status \"ready\" instead of \"ok\"",
    "models_not_a_list": "/v1/models answers object \"models\" instead of \"list\"",
    "completion_no_created": "completion answers leave out created",
    "chat_no_role": "chat answers' message has no role",
    "chunk_ids_differ": "every chunk of a stream gets its own id",
    "ignore_include_usage": "stream_options.include_usage is ignored: no usage chunk",
    "stream_drops_first_text": "a stream leaves out the text of its first token",
    "stop_reported_as_length": "requests ended by a stop string or end-of-sequence report finish_reason length",
    "total_without_prompt": "usage.total_tokens leaves out the prompt tokens",
    "non_object_body_500": "a JSON body that is not an object gets 500 instead of 400",
    "error_param_null": "400 errors leave param null",
    "unknown_path_400": "unknown paths get 400 instead of 404",
    "no_token_prompts": "a prompt given as token ids gets 400",
    "serve_while_draining": "new requests are served while draining (/health still says draining)",
    "drain_exit_1": "the process exits 1 once drained",
    "drain_cancels_inflight": "shutdown cancels the requests in flight instead of letting them finish",
    "panic_reported_as_fault": "/health reports cause fault for a panicked engine thread",
    "dead_plain_503": "a request to a dead engine gets a plain-text 503 with no error object",
    "count_stop_as_length": "requests_finished_total counts stop as length",
    "rows_gauge_off_by_one": "engine_rows reports one row more than the plan",
    "in_use_counts_cached": "kv_blocks_in_use counts cached blocks too, so an idle server reads non-zero",
    "hit_rate_percent": "prefix_cache_hit_rate is exported as a percentage",
    "spec_counters_swapped": "spec_drafted_tokens_total and spec_accepted_tokens_total are swapped",
    "rows_option": "poot-serve accepts a --max-num-seqs option",
}

# Names the engine honoured when this was written; used only while the engine does not
# publish its own list as poot.engine.mutations.MUTATIONS.
_ENGINE_FALLBACK = frozenset({
    "youngest_first", "recompile_on_batch_change", "shared_position", "no_length_mask",
    "leak_block_on_cancel", "no_prefix_reuse", "register_recurrent_prefix", "stale_recurrent_state",
})


def engine_mutations() -> frozenset[str]:
    try:
        from poot.engine.mutations import MUTATIONS
    except ImportError:
        return _ENGINE_FALLBACK
    return frozenset(MUTATIONS)


ALL = frozenset(SERVER_MUTATIONS) | engine_mutations()  # every name this build accepts


def split(names: list[str]) -> tuple[frozenset[str], frozenset[str]]:
    """Returns (engine mutations, server mutations); raises ValueError naming unknown ones."""
    engine = engine_mutations()
    unknown = sorted(set(names) - set(SERVER_MUTATIONS) - engine)
    if unknown:
        known = sorted(set(SERVER_MUTATIONS) | engine)
        raise ValueError(f"unknown mutation(s): {', '.join(unknown)}; this build knows: {', '.join(known)}")
    chosen = set(names)
    return frozenset(chosen & engine), frozenset(chosen & set(SERVER_MUTATIONS))
