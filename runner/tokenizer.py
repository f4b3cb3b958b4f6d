"""Tokenizers built from GGUF metadata alone, matching llama.cpp token for token.

Two vocabularies:
- `llama` (SentencePiece style): scores drive a greedy bigram merge; unknown characters fall
  back to <0xXX> byte tokens. Implemented here, after llama.cpp's llm_tokenizer_spm.
- `gpt2` (byte-level BPE): a regex pre-tokenizer named by `tokenizer.ggml.pre`, then ranked
  merges. The merge loop runs in HF `tokenizers` (Rust); the pre-tokenizer regexes are
  llama.cpp's.

Special tokens are split out first, longest first, as llama.cpp does: control tokens only when
`special=True`, user-defined tokens always.
"""

from __future__ import annotations

import codecs
import functools
import heapq

import numpy as np

from fastrun.formats import keys
from fastrun.formats.errors import FastrunError
from fastrun.runner import vocab_cache
from fastrun.runner.vocab_cache import split_merges

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, applied in sequence (llama.cpp's llama-vocab).
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [_GPT2],
    "gpt2": [_GPT2],
    "gpt-2": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
}

SPM_SPACE = "\u2581"  # ▁

# Token texts llama.cpp treats as end-of-generation, forcing them to control type if needed.
EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <end_of_turn> <|endoftext|> </s> "
    "<|eom_id|> <EOT> _<EOT> <|end_of_text|> <end_of_utterance>".split()
)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_level_alphabet()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary."""

    def __init__(
        self,
        model: str,
        tokens: list[str],
        token_types: np.ndarray | None = None,
        scores: np.ndarray | None = None,
        merges: list[str] | None = None,
        pre: str | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        add_bos: bool | None = None,
        add_space_prefix: bool = False,
        *,
        merge_pairs: list[tuple[str, ...]] | None = None,
    ):
        if model not in ("llama", "gpt2"):
            raise FastrunError(f"unsupported tokenizer model {model!r} (fastrun knows llama, gpt2)")
        self.model = model
        self.tokens = tokens
        n = len(tokens)
        _check_tables(tokens, token_types, scores, {"bos": bos_id, "eos": eos_id, "eot": eot_id})
        self.types = (
            np.asarray(token_types, np.int32)
            if token_types is not None
            else np.full(n, keys.TOKEN_NORMAL, np.int32)
        )
        self.scores = (
            np.asarray(scores, np.float32) if scores is not None else np.zeros(n, np.float32)
        )
        self.bos_id, self.eos_id, self.eot_id = bos_id, eos_id, eot_id
        self.add_bos = (model == "llama") if add_bos is None else bool(add_bos)
        self.add_space_prefix = add_space_prefix
        self.token_to_id = dict(zip(tokens, range(n), strict=True))
        self._eog = {i for i in (eos_id, eot_id) if i is not None and 0 <= i < n}
        for text in EOG_TEXTS:
            i = self.token_to_id.get(text)
            if i is not None:
                self._eog.add(i)
                if self.types is not None and self.types[i] != keys.TOKEN_CONTROL:
                    self.types = self.types.copy()
                    self.types[i] = keys.TOKEN_CONTROL
        special_kinds = (keys.TOKEN_CONTROL, keys.TOKEN_USER_DEFINED, keys.TOKEN_UNKNOWN)
        # np.isin over the whole vocabulary: a Python test per token is tens of ms at start-up
        specials = [
            i for i in np.flatnonzero(np.isin(self.types, special_kinds)).tolist() if tokens[i]
        ]
        specials.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self._specials = specials
        if model == "gpt2":
            if merge_pairs is None:  # merge_pairs: the merges split (the vocabulary cache's)
                merge_pairs = split_merges(merges or [])
            self._bpe = self._build_bpe(merge_pairs, pre or "default")

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf) -> Tokenizer:
        """Build from an open GGUFFile (or a path)."""
        from fastrun.formats import GGUFFile

        if not isinstance(gguf, GGUFFile):
            with GGUFFile(gguf) as f:
                return cls.from_gguf(f)
        model = gguf.get(keys.TOKENIZER_MODEL)
        digest, tokens, pairs = vocab_cache.load(gguf)
        if tokens is None:  # decoded from the file (and cached for the next start)
            tokens, merges = gguf.get(keys.TOKENS), gguf.get(keys.MERGES)
            pairs = None if merges is None else split_merges(merges)
            if tokens is not None:
                vocab_cache.save(digest, tokens, pairs)
        if model is None or tokens is None:
            raise FastrunError(f"{gguf.path}: no tokenizer in the file")
        return cls(
            model=model,
            tokens=tokens,
            token_types=gguf.get(keys.TOKEN_TYPE),
            scores=gguf.get(keys.SCORES),
            merge_pairs=pairs,
            pre=gguf.get(keys.TOKENIZER_PRE),
            bos_id=gguf.get(keys.BOS_ID),
            eos_id=gguf.get(keys.EOS_ID),
            eot_id=gguf.get(keys.EOT_ID),
            add_bos=gguf.get(keys.ADD_BOS),
            add_space_prefix=bool(gguf.get(keys.ADD_SPACE_PREFIX, model == "llama")),
        )

    def _build_bpe(self, pairs: list[tuple[str, ...]], pre: str):
        from tokenizers import Regex, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if pre not in PRE_TOKENIZERS:
            known = ", ".join(sorted(PRE_TOKENIZERS))
            raise FastrunError(f"unsupported pre-tokenizer {pre!r} (fastrun knows {known})")
        try:
            bpe = models.BPE(self.token_to_id, pairs, ignore_merges=pre in ("llama-bpe", "llama3"))
        except BaseException as e:  # the library's own exception, or a Rust panic
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            raise FastrunError(_merge_problem(pairs, self.token_to_id) or str(e)) from None
        hf = HFTokenizer(bpe)
        splits = [
            pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)
            for rx in PRE_TOKENIZERS[pre]
        ]
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return hf

    # -- properties ------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for (a token's bytes bound them;
        a character takes at most 4 bytes): a text longer than n times this needs more than n
        tokens, which is known before tokenizing it."""
        return 4 * max(map(len, self.tokens)) + 1

    @property
    def eog_ids(self) -> frozenset[int]:
        """End-of-generation tokens: EOS, EOT and the end-of-turn markers llama.cpp knows."""
        return frozenset(self._eog)

    # -- encode ----------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of text; BOS per the file unless add_bos says otherwise; control-token
        strings such as <|im_start|> are parsed as tokens only when special=True. Text that
        is not valid Unicode (undecodable bytes of argv or stdin) has them replaced by U+FFFD."""
        text = valid_text(text)
        add_bos = self.add_bos if add_bos is None else add_bos
        out: list[int] = [self.bos_id] if add_bos and self.bos_id is not None else []
        prev_special = True
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm(frag))
            else:
                out.extend(self._bpe.encode(frag, add_special_tokens=False).ids)
            prev_special = False
        return out

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split text on special-token strings, longest token first (llama.cpp's order)."""
        frags: list[str | int] = [text]
        for tid in self._specials:
            if not special and self.types[tid] != keys.TOKEN_USER_DEFINED:
                continue
            tok = self.tokens[tid]
            if tok not in text:
                continue
            new: list[str | int] = []
            for frag in frags:
                if isinstance(frag, int) or tok not in frag:
                    new.append(frag)
                    continue
                parts = frag.split(tok)
                for k, part in enumerate(parts):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return [f for f in frags if f != ""]

    def _spm(self, text: str) -> list[int]:
        """SentencePiece-style merge: repeatedly join the adjacent pair whose joined text is the
        highest-scoring token (leftmost on ties); leftover characters become byte tokens."""
        text = text.replace(" ", SPM_SPACE)
        sym = list(text)
        n = len(sym)
        if n == 0:
            return []
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        vocab, scores = self.token_to_id, self.scores
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = sym[left] + sym[right]
            tid = vocab.get(joined)
            if tid is not None:
                heapq.heappush(heap, (-float(scores[tid]), left, right, len(joined)))

        for i in range(1, n):
            push(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
                continue  # stale: one side has merged since
            sym[left] += sym[right]
            sym[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        out = []
        i = 0
        while i != -1:
            tid = vocab.get(sym[i])
            if tid is not None:
                out.append(tid)
            else:
                for b in sym[i].encode("utf-8"):
                    out.append(self._byte_token(b))
            i = nxt[i]
        return out

    def _byte_token(self, b: int) -> int:
        tid = self.token_to_id.get(f"<0x{b:02X}>")
        if tid is None:
            raise FastrunError(f"the vocabulary has no byte token for 0x{b:02X}")
        return tid

    # -- decode ----------------------------------------------------------------------------

    def token_bytes(self, tid: int) -> bytes:
        """The bytes a token stands for."""
        tok = self.tokens[tid]
        ttype = self.types[tid]
        if ttype in (keys.TOKEN_CONTROL, keys.TOKEN_USER_DEFINED, keys.TOKEN_UNKNOWN):
            return tok.encode("utf-8")
        if self.model == "gpt2":
            try:
                return bytes(_CHAR_TO_BYTE[c] for c in tok)
            except KeyError:
                return tok.encode("utf-8")
        if ttype == keys.TOKEN_BYTE and len(tok) == 6 and tok.startswith("<0x"):
            return bytes([int(tok[3:5], 16)])
        return tok.replace(SPM_SPACE, " ").encode("utf-8")

    def decode(self, ids) -> str:
        """Text of a sequence of ids (invalid UTF-8 becomes U+FFFD)."""
        data = b"".join(self.token_bytes(int(i)) for i in ids if 0 <= int(i) < self.n_vocab)
        text = data.decode("utf-8", errors="replace")
        if self.model == "llama" and self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


def valid_text(text: str) -> str:
    """text, with lone surrogates (how Python keeps undecodable bytes of argv, or a broken
    UTF-16 pair from JSON) replaced by U+FFFD; they cannot be encoded to UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")  # argv's bytes, as they were
        except UnicodeEncodeError:
            raw = text.encode("utf-8", "surrogatepass")
        return raw.decode("utf-8", "replace")


def _check_tables(tokens, token_types, scores, special_ids: dict) -> None:
    """The vocabulary's tables agree: one type and one score per token, special ids inside the
    vocabulary, byte tokens spelled <0xHH>. One FastrunError naming the table otherwise."""
    n = len(tokens)
    if n == 0:
        raise FastrunError("the vocabulary is empty")
    for what, table in (("token types", token_types), ("scores", scores)):
        if table is not None and len(table) != n:
            raise FastrunError(f"the vocabulary has {n} tokens but {len(table)} {what}")
    for name, tid in special_ids.items():
        if tid is not None and not (_is_int(tid) and 0 <= tid < n):
            raise FastrunError(f"the {name} token id {tid!r} is outside the vocabulary ({n})")
    if token_types is None:
        return
    for tid in np.flatnonzero(np.asarray(token_types) == keys.TOKEN_BYTE):
        tok = tokens[tid]
        if len(tok) == 6 and tok.startswith("<0x") and not _is_hex(tok[3:5]):
            raise FastrunError(f"byte token {tid} is {tok!r}, not <0xHH>")


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in text)


def _merge_problem(pairs: list[tuple], vocab: dict[str, int]) -> str | None:
    """The first merge the BPE model refuses, in words: run only once construction failed."""
    for k, pair in enumerate(pairs):
        shown = repr(" ".join(pair)[:40])
        if len(pair) != 2:
            return f"merge {k} ({shown}) is not two tokens joined by a space"
        for part in (*pair, pair[0] + pair[1]):
            if part not in vocab:
                return f"merge {k} ({shown}): {part[:40]!r} is not in the vocabulary"
    return None


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns only whole UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, tid: int) -> str:
        text = self._utf8.decode(self.tokenizer.token_bytes(int(tid)))
        if self._first and text:
            self._first = False
            tok = self.tokenizer
            if tok.model == "llama" and tok.add_space_prefix and text.startswith(" "):
                text = text[1:]
        return text

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
