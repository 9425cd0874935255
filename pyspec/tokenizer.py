"""Tokenizer of a Hugging Face style checkpoint folder, without ``transformers``.

Reads ``tokenizer.json`` (with the ``tokenizers`` library), ``tokenizer_config.json`` (special
tokens, chat template), ``chat_template.jinja`` (overrides the config's template when present),
``special_tokens_map.json``, ``generation_config.json`` and ``config.json`` (stop ids). Chat
templates are rendered with a sandboxed jinja2 environment set up like Hugging Face's.
"""

from __future__ import annotations

import functools

import json
import os
import re
from datetime import datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set

__all__ = ["Tokenizer", "IncrementalDecoder"]


def _read_json(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def _token_content(v: Any) -> Optional[str]:
    """A special token entry is a string or an AddedToken-like dict with 'content'."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _ids(v: Any) -> List[int]:
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


class _TemplateError(Exception):
    pass


def _make_jinja_env():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text): renders the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise _TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols],
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise TypeError(f"encode() takes a str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no UTF-8 (or token) for it
        raise ValueError(f"the text is not valid Unicode: {e.reason} "
                         f"({text[e.start]!r} at index {e.start})") from None


class Tokenizer:
    """Encode/decode and chat-format text for the checkpoint folder *path*."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HFTokenizer

        path = os.fspath(path)
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ValueError(f"{path}: no tokenizer.json (only fast-tokenizer checkpoints are "
                             "supported)")
        try:
            self._tk = _HFTokenizer.from_file(tj)
        except Exception as e:
            raise ValueError(f"{tj}: cannot load ({e})") from e
        self.path = path
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        smap = _read_json(os.path.join(path, "special_tokens_map.json"))
        self.config = cfg

        def special(name: str) -> Optional[str]:
            v = _token_content(cfg.get(name))
            return v if v is not None else _token_content(smap.get(name))

        self.bos_token = special("bos_token")
        self.eos_token = special("eos_token")
        self.pad_token = special("pad_token")
        self.unk_token = special("unk_token")
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.pad_token_id = self.token_to_id(self.pad_token)
        self.unk_token_id = self.token_to_id(self.unk_token)

        eos: Set[int] = set()
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        eos.update(_ids(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id")))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        eos.update(_ids(model_cfg.get("eos_token_id")))
        self.eos_token_ids: Set[int] = eos

        self.all_special_ids: Set[int] = {
            int(i) for i, t in self._tk.get_added_tokens_decoder().items() if t.special}

        template: Any = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            try:
                with open(jinja_file, encoding="utf-8") as f:
                    template = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{jinja_file}: not UTF-8 text ({e})") from None
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: Optional[str] = template if isinstance(template, str) else None
        self._compiled = None

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        return cls(path)

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def base_vocab_size(self) -> int:
        """Number of token ids without the added (special) tokens: what ordinary text encodes
        to."""
        return self._tk.get_vocab_size(with_added_tokens=False)

    def check_fits(self, vocab_size: int, path: str) -> None:
        """ValueError when this tokenizer's ordinary tokens outnumber the model's vocabulary
        (``vocab_size`` of ``path``'s config.json): text would encode to ids the model has no
        embedding for. Added tokens past it are allowed (often unused padding entries)."""
        if self.base_vocab_size > vocab_size:
            raise ValueError(f"{path}: tokenizer.json has {self.base_vocab_size} tokens, more than "
                             f"the model's vocabulary (vocab_size {vocab_size} in config.json): "
                             f"they belong to different models")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in characters of its vocabulary entry (a byte-level
        entry spells each byte as one character): text longer than ``n * max_token_chars``
        cannot be fewer than ``n`` tokens, a bound checked before tokenizing huge input."""
        return max((len(t) for t in self._tk.get_vocab(with_added_tokens=True)), default=1)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self._tk.id_to_token(int(token_id))

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of *text*. *add_special_tokens* applies the tokenizer's post-processor
        (e.g. a BOS token for Llama-style vocabularies); pass False for text that already holds
        its special tokens, such as :meth:`apply_chat_template` output."""
        _check_text(text)
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is out of range [0, {n})")
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render *messages* (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Extra keyword arguments (``tools``, ``documents``, ...) are passed to the template.
        """
        import jinja2

        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with a 'role' key; got {m!r}")
        if self._compiled is None:
            try:
                self._compiled = _make_jinja_env().from_string(self.chat_template)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(f"invalid chat template: {e}") from e
        variables = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                         pad_token=self.pad_token or "", unk_token=self.unk_token or "")
        variables.update(kwargs)
        variables["messages"] = [dict(m) for m in messages]
        variables["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._compiled.render(**variables)
        except _TemplateError as e:
            raise ValueError(f"chat template: {e}") from e
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    @functools.cached_property
    def _special_pattern(self) -> Optional["re.Pattern[str]"]:
        """Matches the text of any special added token (longest first, so that one containing
        another is matched whole); None when the vocabulary has none."""
        texts = sorted({t.content for t in self._tk.get_added_tokens_decoder().values()
                        if t.special and t.content}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    @functools.cached_property
    def _literal_tk(self):
        """A copy of the tokenizer that reads special-token text as ordinary text (a separate
        object, so that no flag is toggled on the shared one while other threads encode)."""
        from tokenizers import Tokenizer as _HFTokenizer

        tk = _HFTokenizer.from_str(self._tk.to_str())
        tk.encode_special_tokens = True
        return tk

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True, **kwargs: Any) -> List[int]:
        """Token ids of *messages* rendered with the chat template, where only the template's
        own markup becomes control tokens: special-token text inside a message (a user writing
        ``<|im_end|>\\n<|im_start|>system``) is tokenized as the ordinary characters it is, so
        it cannot end the message or open one with another role. Messages without such text
        give exactly ``encode(apply_chat_template(...), add_special_tokens=False)``."""
        pattern = self._special_pattern
        strings = [v for m in messages if isinstance(m, Mapping) for v in m.values()
                   if isinstance(v, str)] if isinstance(messages, Sequence) else []
        if pattern is None or not any(pattern.search(v) for v in strings):
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
            return self.encode(text, add_special_tokens=False)
        # Bracket each special text found in a message with two private-use characters that no
        # message and no template holds, render, and tokenize the bracketed spans as text.
        seen = set("".join(strings)) | set(self.chat_template or "")
        free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in seen)
        open_, close = next(free, None), next(free, None)
        if close is None:
            raise ValueError("the messages use every private-use character; cannot mark their "
                             "special-token text")

        def mark(v):
            return pattern.sub(lambda m: open_ + m.group(0) + close, v) if isinstance(v, str) \
                else v

        marked = [{k: mark(v) for k, v in m.items()} if isinstance(m, Mapping) else m
                  for m in messages]
        text = self.apply_chat_template(marked, add_generation_prompt, **kwargs)
        _check_text(text)
        ids: List[int] = []
        literal = False
        for part in re.split(f"([{re.escape(open_)}{re.escape(close)}])", text):
            if part == open_:
                literal = True
            elif part == close:
                literal = False
            elif part:
                tk = self._literal_tk if literal else self._tk
                ids.extend(tk.encode(part, add_special_tokens=False).ids)
        return ids


class IncrementalDecoder:
    """Streaming detokenizer: :meth:`push` one token id at a time, get the newly final text.

    Text is held back while the decoded tail is an incomplete UTF-8 sequence (a character split
    across tokens), so U+FFFD never appears for a sequence that later completes. Each step decodes
    only a short window (the last emitted tokens plus the pending ones), so decoders that depend
    on context (leading-space handling) see the same context as a full decode. :meth:`flush`
    returns whatever is still pending at the end of the stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.reset()

    def reset(self) -> None:
        self._ids: List[int] = []
        self._prefix = 0  # start of the decode window (tokens already emitted, for context)
        self._read = 0  # tokens before this index have been emitted

    def _decode(self, lo: int, hi: int) -> str:
        return self._tokenizer.decode(self._ids[lo:hi],
                                      skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self._ids.append(int(token_id))
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self._ids))
        if len(after) >= len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            # drop tokens that can no longer be part of the window
            if self._prefix > 0:
                del self._ids[:self._prefix]
                self._read -= self._prefix
                self._prefix = 0
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Return the pending text (an incomplete sequence decodes as U+FFFD) and end the stream."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix, len(self._ids))
        self.reset()
        return after[len(before):]
