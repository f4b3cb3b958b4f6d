"""The OpenAI HTTP API's bodies: requests checked and turned into sampling settings, and the
response objects and stream chunks built from generated pieces. No HTTP here (see server.py).

Unknown fields are ignored, as OpenAI's API does; a field fastrun cannot honour (n > 1, tools,
a JSON response format, logit_bias, echo, best_of > 1) is a 400 that names it. Fields left out
take fastrun's own defaults (those of `fastrun run`), so one greedy request gives the same text
through every door.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import fastrun

SYSTEM_FINGERPRINT = f"fastrun-{fastrun.__version__}"
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MESSAGE_ROLES = {"system", "developer", "user", "assistant"}


class ApiError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class GenerationRequest:
    """One checked request: what to generate from, how, and how to answer."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    messages: list[dict] | None = None  # chat
    prompt: str | list[int] | None = None  # completions: text or token ids
    sampling: dict = field(default_factory=dict)  # SamplingParams keywords (max_tokens optional)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: off; N: each token's logprob and N alternatives


# -- field readers: each checks one value's type and range, naming the field when it is wrong ----


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise invalid(f"'{name}' must be a number from {low} to {high}", name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(f"'{name}' must be an integer >= {low}", name)
    if high is not None and value > high:
        raise invalid(f"'{name}' must be an integer from {low} to {high}", name)
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(s for s in strings if s)


def _refuse_unsupported(body: dict) -> None:
    """A 400 for what fastrun cannot honour rather than a silently different answer."""
    n = _integer(body, "n", 1)
    if n is not None and n > 1:
        raise invalid("fastrun generates one choice per request: 'n' must be 1", "n")
    for name in ("tools", "functions"):
        if body.get(name):
            raise invalid(f"fastrun does not support tool calls ('{name}')", name)
    if body.get("tool_choice") not in (None, "none"):
        raise invalid("fastrun does not support tool calls ('tool_choice')", "tool_choice")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise invalid("fastrun answers in plain text only ('response_format')", "response_format")
    if body.get("logit_bias"):
        raise invalid("fastrun does not support 'logit_bias'", "logit_bias")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid("fastrun answers in text only ('modalities')", "modalities")


def _sampling(body: dict) -> dict:
    """SamplingParams keywords from the request's fields (fastrun's extensions included:
    top_k, min_p, repeat_penalty, ignore_eos, as llama-server accepts them)."""
    readers = {
        "temperature": lambda: _number(body, "temperature", 0.0, 2.0),
        "top_p": lambda: _number(body, "top_p", 0.0, 1.0),
        "top_k": lambda: _integer(body, "top_k", 0),
        "min_p": lambda: _number(body, "min_p", 0.0, 1.0),
        "repeat_penalty": lambda: _number(body, "repeat_penalty", 0.0, 10.0),
        "presence_penalty": lambda: _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": lambda: _number(body, "frequency_penalty", -2.0, 2.0),
        "seed": lambda: _integer(body, "seed", -(2**63), 2**64 - 1),
    }
    settings = {name: value for name, read in readers.items() if (value := read()) is not None}
    if settings.get("seed") is not None and settings["seed"] < 0:
        settings["seed"] &= 2**64 - 1  # numpy seeds are non-negative; keep each seed distinct
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is not None:
        settings["max_tokens"] = max_tokens
    settings["stop"] = _stop(body)
    if _boolean(body, "ignore_eos"):
        settings["ignore_eos"] = True
    return settings


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    if not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    return _boolean(options, "include_usage")


def _message_text(content, index: int) -> str:
    """A message's content as text: a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(
                    f"messages[{index}]: fastrun reads text parts only, not {kind!r}",
                    f"messages[{index}].content",
                )
            if not isinstance(part.get("text"), str):
                raise invalid(f"messages[{index}]: a text part needs 'text'", f"messages[{index}]")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{index}]: 'content' must be a string or a list of parts")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role == "tool" or message.get("tool_calls"):
            raise invalid("fastrun does not support tool calls (tool messages)", f"messages[{i}]")
        if role not in MESSAGE_ROLES:
            raise invalid(
                f"messages[{i}]: 'role' must be one of {', '.join(sorted(MESSAGE_ROLES))}",
                f"messages[{i}].role",
            )
        # "developer" is OpenAI's newer name for the system message; templates know "system"
        role = "system" if role == "developer" else role
        checked.append({"role": role, "content": _message_text(message.get("content"), i)})
    return checked


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("fastrun takes one prompt per request", "prompt")
    raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")


def _request(body: dict, logprobs: int | None, **source) -> GenerationRequest:
    """The fields both endpoints share, checked; `source`: the messages or the prompt."""
    stream = _boolean(body, "stream")
    return GenerationRequest(
        chat="messages" in source,
        sampling=_sampling(body),
        stream=stream,
        include_usage=_stream_options(body, stream),
        logprobs=logprobs,
        **source,
    )


def parse_chat(body: dict) -> GenerationRequest:
    """A /v1/chat/completions body, checked."""
    _refuse_unsupported(body)
    logprobs = None
    if _boolean(body, "logprobs"):
        logprobs = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return _request(body, logprobs, messages=_messages(body))


def parse_completion(body: dict) -> GenerationRequest:
    """A /v1/completions body, checked."""
    _refuse_unsupported(body)
    best_of = _integer(body, "best_of", 1)
    if best_of is not None and best_of > 1:
        raise invalid("fastrun generates one choice per request: 'best_of' must be 1", "best_of")
    if _boolean(body, "echo"):
        raise invalid("fastrun does not support 'echo'", "echo")
    if body.get("suffix"):
        raise invalid("fastrun does not support 'suffix' (fill-in-the-middle)", "suffix")
    return _request(body, _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS), prompt=_prompt(body))


# -- responses ---------------------------------------------------------------------------------


def finish_reason(completion) -> str:
    # "cancelled" (the server is shutting down) is not one of OpenAI's reasons: the reply was
    # cut short, which clients read from "length"
    return "stop" if completion.finish_reason == "stop" else "length"


def usage(completion) -> dict:
    prompt = completion.prompt_tokens
    generated = len(completion.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": prompt - completion.prefilled_tokens},
    }


class ResponseBuilder:
    """The JSON objects of one request's answer, whole or as stream chunks."""

    def __init__(self, request: GenerationRequest, model_id: str, token_text):
        self.request = request
        self.chat = request.chat
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_id = model_id
        self.token_text = token_text  # token id -> its text (for logprobs)
        self.text_offset = 0  # completions' logprobs: where each token's text starts

    def _object(self, kind: str, choices: list, **extra) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model_id,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            **extra,
        }

    # logprobs: chat's {"content": [{token, logprob, bytes, top_logprobs}]} or the legacy
    # completions' {tokens, token_logprobs, top_logprobs, text_offset}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, pieces: list) -> dict | None:
        if self.request.logprobs is None:
            return None
        scored = [p for p in pieces if getattr(p, "logprob", None) is not None]
        if self.chat:
            return {
                "content": [
                    {
                        **self._entry(p.id, p.logprob),
                        "top_logprobs": [self._entry(t, lp) for t, lp in p.top_logprobs or ()],
                    }
                    for p in scored
                ]
            }
        tokens = [self.token_text(p.id) for p in scored]
        offsets = []
        for text in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [p.logprob for p in scored],
            "top_logprobs": [
                {self.token_text(t): lp for t, lp in p.top_logprobs or ()} for p in scored
            ],
            "text_offset": offsets,
        }

    def whole(self, pieces: list, completion) -> dict:
        """The non-streamed answer."""
        text = "".join(pieces)
        choice = {"index": 0, "logprobs": self.logprobs(pieces)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        choice["finish_reason"] = finish_reason(completion)
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, [choice], usage=usage(completion))

    def _chunk(self, content: str | None, logprobs, reason: str | None, role=False) -> dict:
        choice: dict = {"index": 0}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if content is not None:
                delta["content"] = content
            choice["delta"] = delta
        else:
            choice["text"] = content or ""
        choice["logprobs"] = logprobs
        choice["finish_reason"] = reason
        extra = {"usage": None} if self.request.include_usage else {}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [choice], **extra)

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return self._chunk("", None, None, role=True) if self.chat else None

    def piece_chunk(self, piece) -> dict | None:
        logprobs = self.logprobs([piece])
        if not piece and not (logprobs and (logprobs.get("content") or logprobs.get("tokens"))):
            return None  # an incomplete character and nothing to score: nothing to send yet
        return self._chunk(str(piece), logprobs, None)

    def last_chunk(self, completion) -> dict:
        return self._chunk(None if self.chat else "", None, finish_reason(completion))

    def usage_chunk(self, completion) -> dict:
        return self._object(
            "chat.completion.chunk" if self.chat else "text_completion",
            [],
            usage=usage(completion),
        )
