"""The Python API: `fastrun.load(...) -> Model`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import numpy as np

from fastrun.backends import get_backend
from fastrun.formats import keys
from fastrun.formats.errors import FastrunError
from fastrun.formats.gguf import GGUFFile
from fastrun.runner.chat import ChatTemplate
from fastrun.runner.generate import Completion, Token, stream
from fastrun.runner.models import model_class
from fastrun.runner.registry import resolve_model
from fastrun.runner.sampling import SamplingParams
from fastrun.runner.tokenizer import Tokenizer

DEFAULT_CTX = 4096
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(**settings) -> SamplingParams:
    """SamplingParams from keyword settings; an unknown name is a user error."""
    unknown = set(settings) - _SAMPLING_FIELDS
    if unknown:
        raise FastrunError(f"unknown sampling setting(s): {', '.join(sorted(unknown))}")
    if "stop" in settings:
        stop = settings["stop"]
        settings["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(**settings)


class Model:
    """A loaded model with its tokenizer, chat template and one KV cache (one session)."""

    def __init__(
        self,
        path: str | os.PathLike,
        backend: str = "auto",
        n_ctx: int | None = None,
        threads: int | None = None,
        progress=None,
    ):
        self.path = os.fspath(path)
        self.file = GGUFFile(self.path)
        self.tokenizer = Tokenizer.from_gguf(self.file)
        options = {"threads": threads} if backend == "cpu" and threads else {}
        self.backend = get_backend(backend, **options)
        self.transformer = model_class(self.file.architecture)(self.file, self.backend, progress)
        self.config = self.transformer.config
        self.template = ChatTemplate.for_model(self.file.get(keys.CHAT_TEMPLATE), self.tokenizer)
        self.n_ctx = int(n_ctx or min(DEFAULT_CTX, self.config.n_ctx_train))
        if self.n_ctx < 2:
            raise FastrunError(f"context size {self.n_ctx} is too small")
        self.cache = self.transformer.new_cache(self.n_ctx)
        self.last = Completion()  # the most recent generation's text, tokens and timings

    # -- text <-> tokens ----------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    # -- scoring --------------------------------------------------------------------------------

    def logprobs(self, tokens) -> np.ndarray:
        """Teacher-forced log-softmax after each prefix: float32 [len(tokens), n_vocab]."""
        tokens = [int(t) for t in tokens]
        cache = self.transformer.new_cache(max(len(tokens), 1))
        logits = self.transformer.forward(tokens, cache, all_logits=True)
        cache.free()
        shifted = logits - logits.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    # -- generation -----------------------------------------------------------------------------

    def prompt_ids(self, prompt_or_ids) -> list[int]:
        if isinstance(prompt_or_ids, str):
            ids = self.tokenize(prompt_or_ids, special=True)
        else:
            ids = [int(i) for i in prompt_or_ids]
        if not ids:
            raise FastrunError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise FastrunError(
                f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx} "
                f"(raise it with --ctx-size, up to {self.config.n_ctx_train})"
            )
        return ids

    def generate(self, prompt_or_ids, **sampling) -> Iterator[Token]:
        """Stream the continuation of a prompt (text or token ids) as Token pieces (str with
        an `.id`). Reuses the cache's common prefix with the previous call."""
        params = sampling_params(**sampling)
        ids = self.prompt_ids(prompt_or_ids)
        self.last = Completion()
        return stream(self.transformer, self.tokenizer, self.cache, ids, params, self.last)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True)
        bos = self.template.bos_token
        add_bos = self.tokenizer.add_bos and not (bos and text.startswith(bos))
        return self.tokenize(text, add_bos=add_bos, special=True)

    def chat(self, messages: list[dict], **sampling) -> Iterator[Token]:
        """Stream the assistant's reply to a conversation ([{"role", "content"}, ...])."""
        return self.generate(self.chat_prompt(messages), **sampling)

    def complete(self, prompt_or_ids, **sampling) -> Completion:
        """Generate to the end and return the Completion (text, tokens, timings)."""
        for _ in self.generate(prompt_or_ids, **sampling):
            pass
        return self.last

    def close(self) -> None:
        self.cache.free()
        self.file.close()


def load(
    model: str | os.PathLike, backend: str = "auto", n_ctx: int | None = None, **kwargs
) -> Model:
    """Load a model by GGUF path or registry name (pulled on first use)."""
    return Model(resolve_model(model), backend=backend, n_ctx=n_ctx, **kwargs)
