"""The official `openai` package as a real client of the reference server: completions
logprobs, echo, chat logprobs with top_logprobs, n choices, streamed and not."""

from __future__ import annotations

import math

import pytest

from .proc import Server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client():
    s = Server()
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    yield c
    c.close()
    s.stop()


def test_completions_logprobs(client):
    r = client.completions.create(model="synthetic", prompt="The quick brown fox", max_tokens=8,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == r.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-6) and top[token] == logprob
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_scores_the_prompt(client):
    prompt = "The quick brown fox"
    r = client.completions.create(model="synthetic", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(p <= 0 for p in choice.logprobs.token_logprobs[1:])
    r = client.completions.create(model="synthetic", prompt=prompt, max_tokens=4, echo=True, temperature=0)
    assert r.choices[0].text.startswith(prompt)


def test_chat_logprobs_with_top_logprobs(client):
    messages = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="synthetic", messages=messages, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 4 and entry.top_logprobs[0].logprob == entry.logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = client.chat.completions.create(model="synthetic", messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=4, stream=True)
    tokens = [e.token for chunk in streamed for c in chunk.choices if c.logprobs and c.logprobs.content
              for e in c.logprobs.content]
    assert tokens == [e.token for e in content]


def test_three_choices(client):
    r = client.completions.create(model="synthetic", prompt="Once upon a time", max_tokens=6,
                                  temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 18  # every choice's tokens, each at most max_tokens
    streamed = client.completions.create(model="synthetic", prompt="Once upon a time", max_tokens=6,
                                         temperature=1.0, seed=5, n=3, stream=True)
    texts = {0: "", 1: "", 2: ""}
    finished = []
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(finished) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model="synthetic", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, n=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
