"""Chat-template rendering that keeps message text apart from the template's special tokens.

A rendered conversation is one string, but not all of it may be tokenized alike:
the template's own markers (`<|eot_id|>`, `<|start_header_id|>`, ...) must become
special tokens, while a message that merely contains those strings must stay text,
or a message could forge turns of the conversation. `render` records where each
message's text sits in the rendered string (`Rendered.spans`), and `encode`
tokenizes a tail of it with special tokens recognized only outside those spans.

The spans come from a second rendering in which every message's text is replaced
by a sentinel; the template's pieces around the sentinels, joined with the texts
(as they are, or stripped, for templates that `trim` them), must give back the
real rendering exactly. Where no such reading exists (a template that rewrites
message text), the whole string is tokenized as before and a warning is logged.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from dataclasses import dataclass

log = logging.getLogger(__name__)
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_plain_encoders: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_plain_lock = threading.Lock()
_warned: set = set()


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its `text`, and the [start, end) `spans` of message text in it."""

    text: str
    spans: tuple = ()


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> Rendered:
    """Render `messages` ({"role", "content"} dicts) with the tokenizer's chat template.

    `Rendered.text` is exactly what `apply_chat_template(..., tokenize=False)` returns;
    `spans` mark each message's content in it (empty if the template rewrites content).
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tokenize=False)
    for shape in (lambda s: s, str.strip):
        spans, parts, pos, at = [], [], 0, 0
        for m in _SENTINEL_RE.finditer(skeleton):
            content = shape(str(messages[int(m.group(1))]["content"]))
            parts += [skeleton[pos:m.start()], content]
            at += m.start() - pos
            spans.append((at, at + len(content)))
            at += len(content)
            pos = m.end()
        parts.append(skeleton[pos:])
        if "".join(parts) == text:
            return Rendered(text, tuple(s for s in spans if s[0] < s[1]))
    key = id(type(tokenizer)), getattr(tokenizer, "name_or_path", "")
    if key not in _warned:
        _warned.add(key)
        log.warning("the chat template rewrites message text: special-token strings inside messages "
                    "will be read as special tokens")
    return Rendered(text)


def encode(tokenizer, rendered: Rendered, start: int = 0) -> list[int]:
    """Token ids of `rendered.text[start:]`, no special tokens added.

    Special-token strings count as special tokens only outside the message spans;
    inside them they are text (see `encode_text`).
    """
    ids, pos, end = [], start, len(rendered.text)
    for a, b in rendered.spans:
        if b <= pos:
            continue
        a = max(a, pos)
        if a > pos:
            ids += tokenizer.encode(rendered.text[pos:a], add_special_tokens=False)
        ids += encode_text(tokenizer, rendered.text[a:b])
        pos = b
    if pos < end:
        ids += tokenizer.encode(rendered.text[pos:end], add_special_tokens=False)
    return ids


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as plain text: a special-token string in it is split like any other text."""
    return _plain_encoder(tokenizer)(text)


def longest_token_chars(tokenizer) -> int | None:
    """The most characters any one token of `tokenizer` spells (its vocabulary's longest entry), or None when
    the tokenizer does not list its vocabulary.

    A byte-level vocabulary spells a token's bytes one character each, and a text has at least as many
    bytes as characters, so a text longer than `n` times this needs more than `n` tokens: a message can
    be refused as too long without tokenizing it (which holds the GIL, seconds for megabytes).
    """
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer that cannot list it: no bound, every message is tokenized
        return None
    return max(map(len, vocab), default=0) or None


def _plain_encoder(tokenizer):
    """A thread-safe encoder that never matches special tokens, built once per tokenizer.

    For a fast (Rust) tokenizer it is a copy with `encode_special_tokens` set, so the
    shared tokenizer's own flag is never toggled under other threads, and it encodes
    without holding the GIL.
    """
    with _plain_lock:
        encoder = _plain_encoders.get(tokenizer)
        if encoder is None:
            encoder = _plain_encoders[tokenizer] = _make_plain_encoder(tokenizer)
        return encoder


def _make_plain_encoder(tokenizer):
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps Hugging Face's
    backend = getattr(hf, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers always brings it
        Tokenizer = None
    if Tokenizer is not None and isinstance(backend, Tokenizer):
        plain = Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        plain.no_truncation()
        plain.no_padding()
        # encode_batch runs without the GIL (encode holds it: a megabyte message stopped every thread for seconds)
        return lambda text: plain.encode_batch([text], add_special_tokens=False)[0].ids
    return lambda text: hf.encode(text, add_special_tokens=False, split_special_tokens=True)
