"""render_chat: HF-compatible templates in a sandbox; every failure is an InvalidRequest."""

from __future__ import annotations

import pytest

from poot.engine import InvalidRequest
from poot.engine.models import synthetic_llama
from poot.engine.models.chat import CHATML_TEMPLATE, render_chat, render_template

from .helpers import SMOLLM2_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2? Ünïcödé ✓"},
]

SMOLLM2_EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2? Ünïcödé ✓<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def with_template(template, special=None):
    model = synthetic_llama(0)
    model.chat_template = template
    if special is not None:
        model.special_tokens = special
    return model


def test_smollm2_template_multi_turn_with_system_prompt():
    assert render_chat(with_template(SMOLLM2_TEMPLATE), CONVERSATION) == SMOLLM2_EXPECTED


def test_smollm2_template_adds_its_default_system_prompt():
    text = render_chat(with_template(SMOLLM2_TEMPLATE), [{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_synthetic_model_template():
    text = render_chat(synthetic_llama(0), [{"role": "user", "content": "hey"}])
    assert text == "<|user|>hey\n<|assistant|>"


def test_no_template_falls_back_to_chatml():
    text = render_chat(with_template(None), [{"role": "user", "content": "x"}])
    assert text == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert render_template(CHATML_TEMPLATE, [{"role": "user", "content": "x"}]) == text


def test_special_token_variables_and_hf_whitespace_rules():
    template = (
        "{{ bos_token }}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "[U]{{ m['content'] }}{{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
    )
    model = with_template(template, {"bos_token": "<s>", "eos_token": "</s>"})
    text = render_chat(model, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    # trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before it
    assert text == "<s>\n[U]a</s>\n"


def test_tojson_keeps_unicode_and_loop_controls_work():
    template = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
    text = render_template(template, [{"role": "user", "content": "é"}, {"role": "user", "content": "z"}])
    assert text == '{"role": "user", "content": "é"}'


@pytest.mark.parametrize("messages, needle", [
    ("hello", "list"),
    ({"role": "user", "content": "x"}, "list"),
    ([], "empty"),
    (["hi"], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": 3, "content": "x"}], "messages[0].role"),
    ([{"role": "wizard", "content": "x"}], "wizard"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": ["parts"]}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "string"),
])
def test_bad_messages_are_invalid_requests(messages, needle):
    with pytest.raises(InvalidRequest) as err:
        render_chat(synthetic_llama(0), messages)
    assert err.value.param == "messages"
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_raise_exception_becomes_invalid_request():
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    model = with_template(template)
    assert render_chat(model, [{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequest) as err:
        render_chat(model, [{"role": "system", "content": "x"}])
    assert "Conversation must start with user" in str(err.value) and err.value.param == "messages"


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] }",                      # syntax error
    "{{ messages[0]['content'].nope.deeper }}",                      # undefined attribute of undefined
    "{{ messages.append({'role': 'user'}) }}",                       # mutation in the immutable sandbox
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",                # the classic escape attempt
    "{{ (1).__class__ }}{{ cycler.__init__.__globals__.os }}",       # more of the same
    "{{ 1 / 0 }}",                                                   # a Python exception
    "{% for i in range(10**9) %}x{% endfor %}",                      # range limit of the sandbox
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",         # unbounded recursion
    "{% set s = 'x' * 1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",  # oversized output
])
def test_broken_or_hostile_templates_are_invalid_requests(template):
    with pytest.raises(InvalidRequest) as err:
        render_chat(with_template(template), [{"role": "user", "content": "x"}])
    assert err.value.param == "messages"
    assert "\n" not in str(err.value)


def test_template_cannot_change_the_callers_messages():
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(InvalidRequest):
        render_chat(with_template("{% set _ = messages[0].update({'content': 'y'}) %}"), messages)
    assert messages == [{"role": "user", "content": "x"}]
