"""Deliberate defects the engine can be started with, one name each.

They exist only so the conformance suite and the engine's own tests can prove that each
check fails against an engine that breaks the rule it guards. Nothing turns one on except
an explicit `mutations=` argument (the server's hidden `--mutation` option).
"""

MUTATIONS: dict[str, str] = {
    "youngest_first": "the scheduler opens the youngest waiting request first",
    "reserve_prompt_only": "opening reserves the prompt's blocks only; decode grows the table as it goes",
    "prefill_only_steps": "a step that prefills leaves the decoding rows out",
    "no_prefill_budget": "beside decoding rows, a waiting prompt is prefilled whole in one step, whatever the budget",
    "no_idle_prefill_budget": "with no row decoding, a waiting prompt is prefilled whole in one step, whatever the idle budget",
    "keep_cancelled_waiting": "a queued request whose owner left stays queued and opens later",
    "continue_after_eos": "end-of-sequence is ignored; only max_tokens ends a request",
    "off_by_one_max_tokens": "one token more than max_tokens is produced",
    "refuse_kills_engine": "a refused step is treated as a fault and the engine dies",
    "recompile_on_batch_change": "the driver builds a new entry whenever the batch size changes",
    "shared_position": "every token of a step gets one shared position",
    "no_length_mask": "decode attention reads every gathered slot, written or not",
    "leak_block_on_cancel": "a cancelled request keeps one block for good",
    "no_prefix_reuse": "prefix lookups never hit",
    "no_prefix_registration": "released requests register nothing",
    "no_cancel_prefix": "a cancelled request registers nothing",
    "register_recurrent_prefix": "a recurrent-state model registers prompt blocks like an attention model",
    "stale_recurrent_state": "a row's recurrent state is not reset when a new request opens it",
    "ignore_seed": "sampling ignores the request's seed",
    "keep_stop_string": "a request ended by a stop string still outputs the stop string",
    "clamp_max_tokens": "a request that can never fit is cut to fit instead of refused",
    "accept_all_drafts": "verification keeps going past a rejected draft token",
    "refuse_fails_waiting": "a refused step also fails every waiting request",
    "one_row_per_step": "each step decodes one row only: rows take turns instead of sharing steps",
    "refuse_when_full": "a request that finds every row taken is refused instead of queued",
    "preempt_youngest": "a request kept waiting takes the row of the youngest running request, which fails",
    "stop_keeps_row": "a request ended by a stop string keeps its row and blocks (streams free them on close)",
    "prefix_hit_refeeds_prompt": "after a prefix-cache hit, the prompt is fed again from its start at the positions after the cached blocks",
}
