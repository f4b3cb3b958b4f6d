"""GGUF tokenizer metadata from a Hugging Face folder, as convert_hf_to_gguf.py writes it.

Byte-level BPE tokenizers (tokenizer.json with a BPE model and no byte fallback: Llama 3,
Qwen2, SmolLM, GPT-2 and their kin) become `tokenizer.ggml.model = "gpt2"`: the vocabulary
with a type per token, the merges, the special-token ids and add_bos/add_eos flags read from
tokenizer.json, tokenizer_config.json and config.json, and the chat template.

`tokenizer.ggml.pre` names the pre-tokenizer (the regex that splits text before merging). The
converter recognises it by hashing the ids of a fixed text; this module knows the hashes of
the pre-tokenizers fastrun's tokenizer implements, and otherwise reads the regex from
tokenizer.json, which also covers vocabularies of one's own.
"""

from __future__ import annotations

import hashlib
import json
import os

from fastrun.formats import keys
from fastrun.formats.errors import FastrunError, shown
from fastrun.formats.writer import BOOL, INT32, STRING, UINT32, MetadataValue, array_value

# The converter's test text (convert_hf_to_gguf_update.py's `chktxt`); its ids' sha256 names
# the pre-tokenizer. It must stay byte for byte as it is there.
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis "
    "concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 "
    "កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български "
    "''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not "
    "sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
# Hashes from the converter's get_vocab_base_pre, for the pre-tokenizers fastrun runs.
KNOWN_HASHES = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen1.5/2
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen3 emb.
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
}
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# The Split regex of tokenizer.json's pre_tokenizer -> the llama.cpp pre-tokenizer that is it.
KNOWN_REGEXES = {
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL: "llama-bpe",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL: "qwen2",
}
SPECIAL_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
_ID_KEYS = {
    "bos": keys.BOS_ID,
    "eos": keys.EOS_ID,
    "unk": keys.UNK_ID,
    "sep": "tokenizer.ggml.seperator_token_id",  # llama.cpp's spelling
    "pad": keys.PAD_ID,
    "cls": "tokenizer.ggml.cls_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}


def load_json(folder: str, name: str, required: bool = False):
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        if required:
            raise FastrunError(f"{folder} has no {name}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise FastrunError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise FastrunError(f"{name} is not a JSON object")
    return data


def _looks_special(token: str) -> bool:
    """Added tokens some models forget to mark special (the converter's list)."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


class HFTokenizer:
    """A folder's byte-level BPE tokenizer; `metadata(...)` gives its GGUF keys."""

    def __init__(self, folder: str, config: dict):
        self.folder = folder
        self.config = config
        if os.path.isfile(os.path.join(folder, "tokenizer.model")):
            raise FastrunError(
                "SentencePiece tokenizers (tokenizer.model) are not supported yet; "
                "convert this folder with llama.cpp's convert_hf_to_gguf.py"
            )
        self.spec = load_json(folder, "tokenizer.json", required=True)
        self.tokenizer_config = load_json(folder, "tokenizer_config.json")
        model = self.spec.get("model")
        if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback"):
            raise FastrunError(
                "tokenizer.json is not a byte-level BPE tokenizer (the kind fastrun converts)"
            )
        self.vocab = model.get("vocab")
        if not isinstance(self.vocab, dict) or not all(
            isinstance(t, str) and isinstance(i, int) and i >= 0 for t, i in self.vocab.items()
        ):
            raise FastrunError("tokenizer.json: model.vocab is not a map of tokens to ids")
        self.added = self.spec.get("added_tokens") or []
        if not isinstance(self.added, list) or not all(
            isinstance(a, dict)
            and isinstance(a.get("id"), int)
            and isinstance(a.get("content"), str)
            for a in self.added
        ):
            raise FastrunError("tokenizer.json: added_tokens is not a list of {id, content}")
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_str(json.dumps(self.spec))
        except Exception as e:  # the Rust parser's error: the file is malformed
            raise FastrunError(f"tokenizer.json cannot be loaded: {e}") from None

    # -- vocabulary ------------------------------------------------------------------------

    def tokens(self, vocab_size: int) -> tuple[list[str], list[int]]:
        """Token texts and types for ids 0..vocab_size-1; holes become [PAD{id}], unused."""
        by_id = {i: t for t, i in self.vocab.items()}
        by_id.update({a["id"]: a["content"] for a in self.added})
        if by_id and max(by_id) >= vocab_size:
            raise FastrunError(
                f"tokenizer.json has token id {max(by_id)}, beyond vocab_size {vocab_size}"
            )
        added = {a["id"]: a for a in self.added}
        tokens, types = [], []
        for i in range(vocab_size):
            token = by_id.get(i)
            if token is None:
                tokens.append(f"[PAD{i}]")
                types.append(keys.TOKEN_UNUSED)
                continue
            entry = added.get(i)
            if entry is None:
                types.append(keys.TOKEN_NORMAL)
            else:
                if not entry.get("normalized", True):
                    # llama.cpp expects added tokens pre-normalized: encode and decode them
                    ids = self.tokenizer.encode(token, add_special_tokens=False).ids
                    token = self.tokenizer.decode(ids, skip_special_tokens=False)
                if entry.get("special") or _looks_special(token):
                    types.append(keys.TOKEN_CONTROL)
                else:
                    token = token.replace("\u2581", " ")  # user-defined spaces, pre-normalized
                    types.append(keys.TOKEN_USER_DEFINED)
            tokens.append(token)
        return tokens, types

    def merges(self) -> list[str]:
        merges = self.spec["model"].get("merges") or []
        if not isinstance(merges, list):
            raise FastrunError("tokenizer.json: model.merges is not a list")
        if all(isinstance(m, str) for m in merges):
            return merges
        out = []
        for m in merges:  # the pair format of transformers >= 4.45: spaces stay spaces
            if not (isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m)):
                raise FastrunError(f"tokenizer.json: a merge is {shown(repr(m))}")
            # llama.cpp separates a merge's parts by a space; a space inside one is U+0120
            out.append(" ".join(p.replace(" ", "\u0120") for p in m))
        return out

    def pre_tokenizer(self) -> str:
        ids = self.tokenizer.encode(CHECK_TEXT).ids
        digest = hashlib.sha256(str(ids).encode()).hexdigest()
        if digest in KNOWN_HASHES:
            return KNOWN_HASHES[digest]
        pre = self.spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []
        for step in steps:
            pattern = step.get("pattern") if isinstance(step, dict) else None
            if step.get("type") == "Split" and isinstance(pattern, dict):
                name = KNOWN_REGEXES.get(pattern.get("Regex"))
                if name is not None:
                    return name
        if [s.get("type") for s in steps] == ["ByteLevel"] and steps[0].get("use_regex", True):
            return "gpt-2"
        raise FastrunError(
            "tokenizer.json's pre-tokenizer is not one fastrun knows "
            f"(known: {', '.join(sorted(set(KNOWN_HASHES.values())))})"
        )

    # -- special tokens --------------------------------------------------------------------

    def _special_tokens(self) -> tuple[dict[str, int], dict[str, bool]]:
        """(type -> id, type -> add it?) read as the converter's SpecialVocab reads them:
        tokenizer.json's post-processor, then tokenizer_config.json, then config.json."""
        ids: dict[str, int] = {}
        add: dict[str, bool] = {}
        tc = dict(self.tokenizer_config or {})

        def content(entry) -> str | None:
            if isinstance(entry, dict):
                entry = entry.get("content")
            return entry if isinstance(entry, str) else None

        if not content(tc.get("bos_token")) and content(tc.get("cls_token")):
            tc["bos_token"] = tc["cls_token"]
        if not content(tc.get("eos_token")) and content(tc.get("sep_token")):
            tc["eos_token"] = tc["sep_token"]
        bos, cls, eos = (content(tc.get(f"{t}_token")) for t in ("bos", "cls", "eos"))
        post = self.spec.get("post_processor") or {}
        processors = post.get("processors", [post]) if isinstance(post, dict) else []
        for proc in processors:
            kind = proc.get("type") if isinstance(proc, dict) else None
            if kind == "ByteLevel":
                add.setdefault("bos", False)
                add.setdefault("eos", False)
            elif kind == "RobertaProcessing":
                add.update(bos=True, eos=True, sep=True)
            elif kind == "TemplateProcessing":
                single = proc.get("single") or []
                if isinstance(single, list) and len(single) > 1:
                    first = _template_special(single[0])
                    if first:
                        if not self.tokenizer_config:
                            bos = first
                        add["bos"] = first in (bos, cls)
                    last = _template_special(single[-1])
                    if last:
                        if not self.tokenizer_config:
                            eos = last
                        add["eos"] = last == eos
        if self.tokenizer_config:
            tc["bos_token"], tc["eos_token"] = bos, eos
            for typ in SPECIAL_TYPES:
                flag = tc.get(f"add_{typ}_token")
                if isinstance(flag, bool) and typ not in add:
                    add[typ] = flag
                text = content(tc.get(f"{typ}_token"))
                if text is None:
                    continue
                tid = next((a["id"] for a in self.added if a["content"] == text), None)
                if tid is not None:
                    ids.setdefault(typ, tid)
        for typ in SPECIAL_TYPES:
            tid = self.config.get(f"{typ}_token_id")
            if tid is None:
                tid = (self.config.get("text_config") or {}).get(f"{typ}_token_id")
            if isinstance(tid, int) and not isinstance(tid, bool):
                if tid < 0:
                    raise FastrunError(f"config.json: {typ}_token_id is {tid}")
                ids.setdefault(typ, tid)
        return ids, add

    def chat_templates(self) -> dict[str, str]:
        """GGUF key -> template: tokenizer_config.json's, else chat_template.jinja or .json
        (the converter reads none without a tokenizer_config.json)."""
        if self.tokenizer_config is None:
            return {}
        template = self.tokenizer_config.get("chat_template")
        if template is None:
            jinja = os.path.join(self.folder, "chat_template.jinja")
            if os.path.isfile(jinja):
                with open(jinja, encoding="utf-8") as f:
                    template = f.read()
            else:
                template = (load_json(self.folder, "chat_template.json") or {}).get("chat_template")
        if template is None:
            return {}
        if isinstance(template, str):
            return {keys.CHAT_TEMPLATE: template}
        if isinstance(template, list):  # named templates: the default one is the chat template
            template = next(
                (
                    t.get("template")
                    for t in template
                    if isinstance(t, dict) and t.get("name") == "default"
                ),
                None,
            )
            return {} if not isinstance(template, str) else {keys.CHAT_TEMPLATE: template}
        raise FastrunError("tokenizer_config.json: chat_template is neither text nor a list")

    # -- all together ----------------------------------------------------------------------

    def metadata(self, vocab_size: int, arch: str) -> dict[str, MetadataValue]:
        meta: dict[str, MetadataValue] = {}
        prefix_space = (self.tokenizer_config or {}).get("add_prefix_space")
        if arch == "llama" and isinstance(prefix_space, bool):
            meta[keys.ADD_SPACE_PREFIX] = MetadataValue(BOOL, prefix_space)
        tokens, types = self.tokens(vocab_size)
        meta[keys.TOKENIZER_MODEL] = MetadataValue(STRING, "gpt2")
        meta[keys.TOKENIZER_PRE] = MetadataValue(STRING, self.pre_tokenizer())
        meta[keys.TOKENS] = array_value(STRING, tokens)
        meta[keys.TOKEN_TYPE] = array_value(INT32, types)
        meta[keys.MERGES] = array_value(STRING, self.merges())
        ids, add = self._special_tokens()
        for typ, tid in ids.items():
            if tid < vocab_size:
                meta[_ID_KEYS[typ]] = MetadataValue(UINT32, tid)
        for typ, flag in add.items():
            if typ in ("bos", "eos", "sep"):
                meta[f"tokenizer.ggml.add_{typ}_token"] = MetadataValue(BOOL, flag)
        if arch == "llama" and vocab_size == 49152:
            # the converter's rule for this vocabulary size (Granite's and SmolLM's): no BOS
            meta[keys.ADD_BOS] = MetadataValue(BOOL, False)
        for key, template in self.chat_templates().items():
            meta[key] = MetadataValue(STRING, template)
        return meta


def _template_special(piece) -> str | None:
    token = piece.get("SpecialToken") if isinstance(piece, dict) else None
    tid = token.get("id") if isinstance(token, dict) else None
    return tid if isinstance(tid, str) else None
