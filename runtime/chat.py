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

Before rendering, the messages are fitted to what the template takes (`template_habits`,
`fit_messages`): templates that want roles to alternate get each run of one role as one
message, templates without a system role get the system prompt in the first user message,
and a tokenizer without a template renders plain lines (`FALLBACK_TEMPLATE`).
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from dataclasses import dataclass

from runtime.errors import AdvisedError

log = logging.getLogger(__name__)
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {what: made once for it}
_made_lock = threading.RLock()
_warned: set = set()


@dataclass(frozen=True)
class Rendered:
    """A rendered conversation: its `text`, and the [start, end) `spans` of message text in it."""

    text: str
    spans: tuple = ()


class ChatTemplateError(AdvisedError, ValueError):
    """The model's chat template refuses a conversation (its own `raise_exception`, or any failure inside it).

    `turn_id` names the turn whose conversation it was (None outside a turn). Nothing was recorded: start
    the conversation over (`ref.reset`) with messages the template takes. `detail` is the message without
    `advice`, its advice on what to call next (an HTTP server words its own).
    """

    def __init__(self, message: str, turn_id: str | None = None, advice: str = ""):
        super().__init__(message, advice, turn_id)


# for a tokenizer without a chat template (a base model): its BOS token, then plain "User:" / "Assistant:"
# lines, as mlx-lm's server does for such models
FALLBACK_TEMPLATE = ("{{ bos_token or '' }}{% for m in messages %}"
                     "{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
                     "{% elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n' }}"
                     "{% else %}{{ 'Assistant: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")  # as a reply renders: hot turns


@dataclass(frozen=True)
class TemplateHabits:
    """What a tokenizer's chat template takes, found once per tokenizer by rendering two small conversations."""

    template: str | None  # None: the tokenizer's own; FALLBACK_TEMPLATE where it has none
    merge: bool  # it refuses two messages of one role in a row (roles must alternate): such runs are joined
    fold_system: bool  # it refuses a system message: the system prompt opens the first user message


def _once(tokenizer, make):
    """`make(tokenizer)`, made once per tokenizer (under a lock, so never twice) and kept while it lives."""
    with _made_lock:
        made = _made.setdefault(tokenizer, {})
        if make not in made:
            made[make] = make(tokenizer)
        return made[make]


def template_habits(tokenizer) -> TemplateHabits:
    """`TemplateHabits` of `tokenizer` (found once per tokenizer)."""
    return _once(tokenizer, _find_habits)


def _find_habits(tokenizer) -> TemplateHabits:
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
    if template is not None:
        log.warning("the tokenizer has no chat template: conversations render as plain 'User:' and "
                    "'Assistant:' lines")

    def takes(messages) -> bool:
        try:
            _apply(tokenizer, messages, True, template)
            return True
        except Exception:  # noqa: BLE001 - a template refuses with whatever it raises
            return False

    user, system = {"role": "user", "content": "a"}, {"role": "system", "content": "s"}
    return TemplateHabits(template, merge=not takes([user, user]), fold_system=not takes([system, user]))


def fit_messages(messages: list[dict], habits: TemplateHabits) -> list[dict]:
    """`messages` as a template with `habits` takes them: a system prompt it refuses opens the first user
    message, and where roles must alternate, each run of messages of one role becomes one message (their
    texts joined by a blank line). Unchanged for a template that takes any order."""
    out = [dict(m) for m in messages]
    if habits.fold_system and out and out[0]["role"] == "system":
        system = out.pop(0)["content"]
        if system and out and out[0]["role"] == "user":
            out[0]["content"] = f"{system}\n\n{out[0]['content']}"
        elif system:
            out.insert(0, {"role": "user", "content": system})
    if habits.merge:
        merged = []
        for m in out:
            if merged and merged[-1]["role"] == m["role"]:
                merged[-1]["content"] = f"{merged[-1]['content']}\n\n{m['content']}"
            else:
                merged.append(m)
        out = merged
    return out


def _apply(tokenizer, messages, add_generation_prompt: bool, template: str | None) -> str:
    extra = {} if template is None else {"chat_template": template}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **extra)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> Rendered:
    """Render `messages` ({"role", "content"} dicts) with the tokenizer's chat template.

    The messages are first fitted to what the template takes (`fit_messages`: templates that want roles to
    alternate, or take no system message); a tokenizer without a template renders through
    FALLBACK_TEMPLATE. `Rendered.text` is exactly what `apply_chat_template(..., tokenize=False)` returns for
    the fitted messages; `spans` mark each message's content in it (empty if the template rewrites
    content). Raises ChatTemplateError where the template still refuses them (say, a conversation that
    opens with an assistant message, for a template that wants a user first).
    """
    habits = template_habits(tokenizer)
    messages = fit_messages(messages, habits)
    try:
        text = _apply(tokenizer, messages, add_generation_prompt, habits.template)
        marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
        skeleton = _apply(tokenizer, marked, add_generation_prompt, habits.template)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or whatever the template's code raised
        raise ChatTemplateError(f"the model's chat template refuses this conversation ({type(e).__name__}: {e})",
                                advice="; start the conversation over with messages it takes (ref.reset, or a new "
                                       "conversation)") from e
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
    return _once(tokenizer, _make_plain_encoder)


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
