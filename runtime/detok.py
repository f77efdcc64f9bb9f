"""The text that generated tokens spell where they stand: one decoder for replies and caches.

A token's text depends on the token before it: SentencePiece tokenizers drop the
leading space of a sequence's first token, and mlx-lm's streaming detokenizers
trim the first token's leading space on purpose. A reply that is later rendered
back into the conversation must be spelled exactly as its tokens sit in the
cache, or the next prompt no longer starts with the cached text and the cache is
lost. So every piece of text is decoded after an anchor token (the token just
before it) with `tokenizer.decode`, the same rule `runtime.prefix.token_ends` uses
to record where each cached token ends.
"""

from __future__ import annotations

import weakref

REPLACEMENT = "\ufffd"

_alone: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {token id: decode([token id])}


class AnchoredDetokenizer:
    """Streams the text of tokens that follow `anchor` (a token id, or None at the start).

    mlx-lm's `StreamingDetokenizer` interface: `add_token`, `text`, `last_segment`,
    `finalize`, `reset`. `text` is the concatenation of the pieces, each piece being
    `decode([anchor] + pending)` minus `decode([anchor])`, so it equals the text these
    tokens add to a context ending in `anchor`. A token whose bytes end inside a
    character (or whose text does not extend the anchor's) is held back until a later
    token completes it; `finalize` flushes what is held back, replacement characters
    and all.
    """

    def __init__(self, tokenizer, anchor: int | None = None):
        self._decode = tokenizer.decode  # looked up once: a wrapper's attribute lookup costs each call
        self._decode_many = _batch_decoder(tokenizer)
        self._alone = _spellings(tokenizer)
        self._known: dict = {}  # (anchor, token) -> decode([anchor, token]), from `expect`
        self._first = None if anchor is None else int(anchor)
        self.reset()

    def expect(self, tokens) -> None:
        """Spell ahead, in one call to the tokenizer where it allows (`_batch_decoder`), what adding `tokens` in
        order will decode when each completes its character: each token after the one before it (the first after
        the anchor), and each of those anchors alone. `add_token` then looks them up; a token held back (inside a
        character) decodes as before. Changes no result, only how many calls the tokenizer gets."""
        if self._decode_many is None:
            return
        tokens = [int(t) for t in tokens]
        before = [self._first if not self.tokens else self.tokens[-1], *tokens[:-1]]
        pairs = list(dict.fromkeys(zip(before, tokens)))
        alone = list(dict.fromkeys(a for a, _ in pairs if a is not None and a not in self._alone))
        texts = self._decode_many([[t] for t in alone] + [[t] if a is None else [a, t] for a, t in pairs])
        self._alone.update(zip(alone, texts))
        self._known.update(zip(pairs, texts[len(alone):]))

    def reset(self):
        """Forget every token added; the anchor is the one given at construction."""
        self.offset = 0
        self.text = ""
        self.tokens = []
        self._pending: list[int] = []
        self._set_anchor(self._first)

    def _set_anchor(self, token: int | None):
        self._anchor = [] if token is None else [token]
        self._base = "" if token is None else self._spelled_alone(token)

    def _spelled_alone(self, token: int) -> str:
        """`decode([token])`, remembered per tokenizer: the text an anchor adds, which the pieces after it drop."""
        base = self._alone.get(token)
        if base is None:
            base = self._alone[token] = self._decode([token])
        return base

    def add_token(self, token) -> bool:
        """Add one token id; True when its text (and any held back before it) was added to `text`."""
        return self.add_tokens((token,))[0] >= 0

    def add_tokens(self, tokens, start: int = 0) -> list[int]:
        """Add token ids in order, as `add_token` one by one: for each, `start` + the length of `text` once its text
        (and any held back before it) was added, or -1 while it is held back. One loop over local names: a cache's
        thousands of token ends are spelled on a thread that shares the GIL with the engine's."""
        known, decode, alone = self._known, self._decode, self._spelled_alone
        anchor, pending, base = self._anchor, self._pending, self._base
        added, length, out = [], len(self.text), []
        for token in tokens:
            token = int(token)
            self.tokens.append(token)
            pending.append(token)
            spelled = known.get((anchor[0] if anchor else None, token)) if len(pending) == 1 else None
            if spelled is None:
                spelled = decode(anchor + pending)
            if not spelled.startswith(base) or spelled.endswith(REPLACEMENT):
                out.append(-1)
                continue
            piece = spelled[len(base):]
            added.append(piece)
            length += len(piece)
            out.append(start + length)
            pending, anchor, base = [], [token], alone(token)
        self.text += "".join(added)
        self._anchor, self._pending, self._base = anchor, pending, base
        return out

    @property
    def last_segment(self) -> str:
        """The text added since the last time this was read."""
        segment = self.text[self.offset:]
        self.offset = len(self.text)
        return segment

    def finalize(self):
        """Add the text of the tokens held back, as `tokenizer.decode` spells them."""
        if not self._pending:
            return
        spelled = self._decode(self._anchor + self._pending)
        if spelled.startswith(self._base):
            self.text += spelled[len(self._base):]
        else:
            self.text += self._decode(self._pending)
        self._set_anchor(self._pending[-1])
        self._pending = []


def _batch_decoder(tokenizer):
    """A function that decodes many id lists in one call, each exactly as `tokenizer.decode` spells it, or None
    where that cannot be promised. A Hugging Face fast tokenizer (mlx-lm's wrapper forwards to it) decodes
    through its `backend_tokenizer` (the `tokenizers` library) and, with `clean_up_tokenization_spaces` off,
    changes nothing after it; `backend_tokenizer.decode_batch` then gives the same texts in one call (tested
    against `decode` on the package's tokenizers)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is None or not hasattr(backend, "decode_batch") or cleans_up:
        return None
    return lambda lists: backend.decode_batch(lists, skip_special_tokens=False) if lists else []


def _spellings(tokenizer) -> dict:
    """The text of each token decoded alone, remembered per tokenizer (an anchor's, asked once a token: a
    conversation's cached tokens are spelled one by one, two decodes each, on a thread that holds the GIL)."""
    try:
        return _alone.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: remembered for this detokenizer only
        return {}
