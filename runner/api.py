"""The Python API: `fastrun.load(...) -> Model`."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from fastrun.backends import get_backend
from fastrun.formats.errors import FastrunError
from fastrun.formats.gguf import GGUFFile
from fastrun.runner import validate
from fastrun.runner.chat import ChatTemplate
from fastrun.runner.engine import Engine, EngineSettings, Stream
from fastrun.runner.generate import Completion
from fastrun.runner.models import model_class
from fastrun.runner.registry import paired_draft, resolve_model
from fastrun.runner.sampling import SamplingParams
from fastrun.runner.speculative import (
    LookupDrafter,
    LookupThenModel,
    ModelDrafter,
    PassCosts,
    SpeculativeSettings,
    Speculator,
    check_vocabularies,
)
from fastrun.runner.tokenizer import Tokenizer

DEFAULT_CTX = 4096
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(**settings) -> SamplingParams:
    """SamplingParams from keyword settings; an unknown name is a user error."""
    unknown = set(settings) - _SAMPLING_FIELDS
    if unknown:
        raise FastrunError(f"unknown sampling setting(s): {', '.join(sorted(unknown))}")
    settings = validate.check_sampling(settings)
    if "stop" in settings:
        stop = settings["stop"]
        settings["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(**settings)


class Model:
    """A loaded model: its weights, tokenizer and chat template, and the engine that runs the
    generations of every caller (threads included) as parallel sequences in shared passes.

    Speculative decoding: draft (a GGUF path or registry name of a small model of the same
    vocabulary; "auto": the one models.toml pairs with this model) or lookup=True (prompt
    lookup), or both (lookup where it finds a match, the draft elsewhere); draft_max,
    draft_min, draft_p_min bound the drafts (speculative.py)."""

    def __init__(
        self,
        path: str | os.PathLike,
        backend: str = "auto",
        n_ctx: int | None = None,
        threads: int | None = None,
        progress=None,
        parallel: int = 4,
        batch_size: int = 512,
        n_keep: int = 4,
        context_shift: bool = True,
        max_queue: int = 256,
        draft: str | os.PathLike | None = None,
        lookup: bool = False,
        draft_max: int = SpeculativeSettings.draft_max,
        draft_min: int = SpeculativeSettings.draft_min,
        draft_p_min: float = SpeculativeSettings.draft_p_min,
        draft_progress=None,
    ):
        self.path = os.fspath(path)
        self.file = GGUFFile(self.path)
        self.tokenizer = Tokenizer.from_gguf(self.file)
        options = {"threads": threads} if backend in ("cpu", "auto") and threads else {}
        self.backend = get_backend(backend, **options)
        self.transformer = model_class(self.file.architecture)(self.file, self.backend, progress)
        self.config = self.transformer.config
        self.template = ChatTemplate.for_file(self.file, self.tokenizer)
        self.n_ctx = int(n_ctx or min(DEFAULT_CTX, self.config.n_ctx_train))
        validate.check_context_size(
            self.n_ctx, self.config, self.backend, n_seq=parallel, max_pass=batch_size
        )
        settings = EngineSettings(
            parallel=parallel, n_ctx=self.n_ctx, batch_size=batch_size, n_keep=n_keep,
            context_shift=context_shift, max_queue=max_queue,
        )  # fmt: skip
        self._speculative = SpeculativeSettings(draft_max, draft_min, draft_p_min)
        # a target pass's seconds, shared by every drafter
        self._target_costs = PassCosts(one_time=self.backend.captures_steps)
        self._chained_costs = PassCosts()  # a chained greedy step's (Speculator.quiet_steps)
        self._acceptance = {}  # drafts' acceptance by drafter label (Speculator.acceptance)
        self.draft_file = None
        self._draft_model = None  # the ModelDrafter, where a draft model was loaded
        if draft is not None:
            self._draft_model = self._load_draft(draft, settings, draft_progress)
        kind = ("lookup+draft" if lookup else "draft") if draft is not None else "lookup"
        speculator = self._speculator(kind) if draft is not None or lookup else None
        self.engine = Engine(self.transformer, self.tokenizer, settings, speculator)
        self._local = threading.local()  # each thread's most recent Completion (`last`)

    def _load_draft(self, draft, settings: EngineSettings, progress) -> ModelDrafter:
        name = paired_draft(self.path) if os.fspath(draft) == "auto" else draft
        self.draft_file = GGUFFile(resolve_model(name))
        check_vocabularies(self.tokenizer, Tokenizer.from_gguf(self.draft_file), str(name))
        model = model_class(self.draft_file.architecture)(self.draft_file, self.backend, progress)
        return ModelDrafter(
            model, self.tokenizer, settings.parallel, settings.n_ctx,
            self._speculative.draft_p_min, settings.batch_size,
        )  # fmt: skip

    def _speculator(self, kind: str) -> Speculator:
        if kind == "lookup":
            drafter = LookupDrafter()
        elif self._draft_model is None:
            raise FastrunError(f"speculation {kind!r} needs a draft model loaded (draft=...)")
        elif kind == "draft":
            drafter = self._draft_model
        else:  # lookup where it finds a match, the model elsewhere
            drafter = LookupThenModel(LookupDrafter(), self._draft_model)
        return Speculator(
            drafter,
            self._speculative,
            self.config.n_vocab,
            self._target_costs,
            self._chained_costs,
            self._acceptance,
        )

    def speculate(self, kind: str | None) -> None:
        """Speculation for the requests that follow: None (plain decoding), "lookup", "draft"
        or "lookup+draft" (these two need the model loaded with a draft); only while no
        request runs. One loaded model can so compare them (scripts/spec_bench.py)."""
        if kind not in (None, "lookup", "draft", "lookup+draft"):
            raise FastrunError(f"unknown speculation {kind!r}: lookup, draft or lookup+draft")
        self.engine.set_speculator(None if kind is None else self._speculator(kind))

    @property
    def draft_transformer(self):
        """The draft model's Transformer, where one was loaded (None: none)."""
        return None if self._draft_model is None else self._draft_model.transformer

    @property
    def last(self) -> Completion:
        """The calling thread's most recent generation: its text, tokens and timings."""
        return getattr(self._local, "last", None) or Completion()

    # -- text <-> tokens ----------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)

    # -- scoring --------------------------------------------------------------------------------

    def logprobs(self, tokens) -> np.ndarray:
        """Teacher-forced log-softmax after each prefix: float32 [len(tokens), n_vocab]."""
        tokens = validate.check_token_ids([int(t) for t in tokens], self.config.n_vocab)

        def score():  # on the engine's thread, which owns the backend
            cache = self.transformer.new_cache(max(len(tokens), 1))
            try:
                return self.transformer.forward(tokens, cache, all_logits=True)
            finally:
                cache.free()

        logits = self.engine.call(score)
        shifted = logits - logits.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))

    # -- generation -----------------------------------------------------------------------------

    def prompt_ids(self, prompt_or_ids) -> list[int]:
        if isinstance(prompt_or_ids, str):
            validate.check_prompt_text(prompt_or_ids, self.tokenizer, self.n_ctx)
            ids = self.tokenize(prompt_or_ids, special=True)
        else:
            ids = validate.check_token_ids([int(i) for i in prompt_or_ids], self.config.n_vocab)
        if not ids:
            raise FastrunError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise FastrunError(
                f"the prompt has {len(ids)} tokens; the context holds {self.n_ctx} "
                f"(raise it with --ctx-size, up to {self.config.n_ctx_train})"
            )
        return ids

    def generate(self, prompt_or_ids, **sampling) -> Stream:
        """Stream the continuation of a prompt (text or token ids) as Token pieces (str with an
        `.id`); the Stream's `completion` fills in as it runs, and closing it cancels. Safe to
        call from several threads: their generations run side by side in the engine."""
        params = sampling_params(**sampling)
        stream = self.engine.submit(self.prompt_ids(prompt_or_ids), params)
        self._local.last = stream.completion
        return stream

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True)
        validate.check_prompt_text(text, self.tokenizer, self.n_ctx)
        bos = self.template.bos_token
        add_bos = self.tokenizer.add_bos and not (bos and text.startswith(bos))
        return self.tokenize(text, add_bos=add_bos, special=True)

    def chat(self, messages: list[dict], **sampling) -> Stream:
        """Stream the assistant's reply to a conversation ([{"role", "content"}, ...])."""
        return self.generate(self.chat_prompt(messages), **sampling)

    def complete(self, prompt_or_ids, **sampling) -> Completion:
        """Generate to the end and return the Completion (text, tokens, timings)."""
        with self.generate(prompt_or_ids, **sampling) as stream:
            for _ in stream:
                pass
        return stream.completion

    def generate_batch(self, prompts: list, **sampling) -> list[Completion]:
        """Run prompts (texts or id lists) as one batch of parallel sequences, to the end."""
        streams = [self.generate(p, **sampling) for p in prompts]
        try:
            for stream in streams:
                for _ in stream:
                    pass
        finally:
            for stream in streams:
                stream.close()
        return [s.completion for s in streams]

    def stats(self) -> dict:
        """The engine's load: parallel, n_ctx, active and queued sequences, steps run."""
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()
        self.file.close()
        if self.draft_file is not None:
            self.draft_file.close()


def load(
    model: str | os.PathLike, backend: str = "auto", n_ctx: int | None = None, **kwargs
) -> Model:
    """Load a model by GGUF path or registry name (pulled on first use)."""
    return Model(resolve_model(model), backend=backend, n_ctx=n_ctx, **kwargs)
