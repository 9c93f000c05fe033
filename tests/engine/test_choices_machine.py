"""The prefix machine with requests of n choices (and echo among them) interleaved: whatever
is cancelled or refused when, every row and block comes back, no block is both free and
held, and each choice ends exactly once."""

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from poot.engine import EngineDead, SamplingParams
from poot.engine.sequence import Status

from .harness import Record
from .test_state_machine import PrefixMachine


class ChoicesMachine(PrefixMachine):
    @rule(system=st.integers(0, 2), cut=st.integers(1, 40), n=st.integers(2, 4), max_tokens=st.integers(0, 12),
          temperature=st.sampled_from([0.0, 0.8]), echo=st.booleans(), logprobs=st.sampled_from([None, 0, 3]),
          penalty=st.sampled_from([0.0, 1.5]))
    def submit_choices(self, system, cut, n, max_tokens, temperature, echo, logprobs, penalty):
        params = SamplingParams(max_tokens=max_tokens if echo else max(1, max_tokens), temperature=temperature,
                                seed=cut, logprobs=logprobs, prompt_logprobs=1 if echo else None,
                                frequency_penalty=penalty)
        recs = [Record() for _ in range(n)]
        try:
            handles = self.engine.submit_choices(self.systems[system][:cut], params, recs)
        except EngineDead:
            assert not self.alive
            return
        self.requests.extend((rec, h, params.max_tokens) for rec, h in zip(recs, handles, strict=True))

    @invariant()
    def hits_map_registered_blocks_and_leave_a_token_to_compute(self):
        """A choice's shared blocks are not prefix hits: they are registered only once
        written, and are mapped by every running member of its group."""
        bs = self.engine.plan.block_size
        for q in self.engine.scheduler.running:
            assert q.num_cached % bs == 0 and q.num_cached < len(q.prompt)
            if q.group is None:
                assert all(self.engine.pool.registered[b] for b in q.block_table[: q.num_cached // bs])
            else:
                shared = q.group.shared_blocks
                for m in q.group.members:
                    if m.status is Status.RUNNING:
                        assert m.block_table[:shared] == q.block_table[:shared]


ChoicesMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("POOT_STATE_EXAMPLES", "300")), stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestChoicesMachine = ChoicesMachine.TestCase
