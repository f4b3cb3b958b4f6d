"""Chat templates: the model's own Jinja template in a sandbox, and the ChatML fallback."""

import pytest

from fastrun.formats import FastrunError
from fastrun.runner.chat import GEMMA, ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chatml_fallback():
    t = ChatTemplate(None)
    text = t.render(MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_gemma_fallback():
    t = ChatTemplate(None, bos_token="<bos>", fallback=GEMMA)
    reply = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
    turns = MESSAGES + reply
    assert t.render(turns) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\n?<end_of_turn>\n"
        "<start_of_turn>model\n"
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


@pytest.mark.parametrize(
    "source, message",
    [
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "took"),
        ("{% for i in range(99999) %}{{ 'x' * 9999 }}{% endfor %}", "more than 1000000 characters"),
        ("{{ 'x' * 1000000000 }}", "stopped"),
        ("{{ ('x' * 99999) | replace('x', 'y' * 99999) }}", "replace would build"),
        ("{{ 'x'.center(999999999) }}", "center would build"),
        ("{{ '{:>999999999}'.format(1) }}", "format would build"),
        ("{{ '%0999999999d' % 1 }}", "would build"),
        ("{{ 9 ** 99999 }}", "stopped"),
        ("{{ range(10**9) }}", "OverflowError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{{ messages | sum }}", "TypeError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "does not compile"),
        ("{{ messages | tojson(indent=1000000000) }}", "indent"),
        ("{{ raise_exception('first line\\nsecond line' * 1000) }}", "chat template: first line$"),
    ],
)
def test_hostile_templates_end_in_one_line(source, message):
    import time

    from fastrun.runner.chat import TemplateLimits

    t0 = time.monotonic()
    template = ChatTemplate(source, limits=TemplateLimits(seconds=0.5, max_chars=1_000_000))
    with pytest.raises(FastrunError, match=message) as e:
        template.render(MESSAGES)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 5


def test_template_compiles_on_first_use_and_limits_come_from_the_environment(monkeypatch):
    broken = ChatTemplate("{% for %}")  # no error until it is used
    with pytest.raises(FastrunError, match="does not compile"):
        broken.render(MESSAGES)
    calls = []
    lazy = ChatTemplate(lambda: calls.append(1) or None)
    assert not calls and lazy.render(MESSAGES).startswith("<|im_start|>system") and calls
    monkeypatch.setenv("FASTRUN_TEMPLATE_MAX_CHARS", "10")
    with pytest.raises(FastrunError, match="FASTRUN_TEMPLATE_MAX_CHARS"):
        ChatTemplate(None).render(MESSAGES)
    monkeypatch.setenv("FASTRUN_TEMPLATE_SECONDS", "soon")
    with pytest.raises(FastrunError, match="FASTRUN_TEMPLATE_SECONDS"):
        ChatTemplate(None)


def test_gemma3_file_gets_gemma_turns_and_stops_at_end_of_turn():
    from helpers import real_model

    from fastrun.formats.gguf import GGUFFile
    from fastrun.runner.tokenizer import Tokenizer

    f = GGUFFile(real_model("gemma3-270m"))  # its file holds no template
    tokenizer = Tokenizer.from_gguf(f)
    template = ChatTemplate.for_file(f, tokenizer)
    assert template.is_fallback and template.source is GEMMA
    assert template.render(MESSAGES[1:]).startswith("<bos><start_of_turn>user\nHi<end_of_turn>")
    assert tokenizer.tokens.index("<end_of_turn>") in tokenizer.eog_ids
