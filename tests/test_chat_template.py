"""Chat templates: the model's own Jinja template in a sandbox, and the ChatML fallback."""

import pytest

from fastrun.formats import FastrunError
from fastrun.runner.chat import ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chatml_fallback():
    t = ChatTemplate(None)
    text = t.render(MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_sandbox_blocks_python_internals():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(FastrunError):
        ChatTemplate(evil).render(MESSAGES)


def test_hf_globals():
    t = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if tools %}{{ raise_exception('no tools') }}{% endif %}"
        "{{ strftime_now('%Y') | length }}",
        bos_token="<s>",
    )
    assert t.render(MESSAGES) == '<s>"Be brief.""Hi"4'
    with pytest.raises(FastrunError, match="no tools"):
        t.render(MESSAGES, tools=[{"name": "x"}])


def test_smollm2_template(smollm2_path):
    from fastrun.runner.api import Model

    m = Model(smollm2_path, n_ctx=256)
    ids = m.chat_prompt([{"role": "user", "content": "Hi"}])
    text = m.detokenize(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert m.tokenizer.token_to_id["<|im_start|>"] in ids
