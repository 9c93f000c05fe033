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
