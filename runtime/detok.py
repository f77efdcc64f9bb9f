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
        self._alone = _spellings(tokenizer)
        self._first = None if anchor is None else int(anchor)
        self.reset()

    def reset(self):
        """Forget every token added; the anchor is the one given at construction."""
        self.offset = 0
        self.text = ""
        self.tokens = []
        self._pending: list[int] = []
        self._set_anchor(self._first)

    def _set_anchor(self, token: int | None):
        self._anchor = [] if token is None else [token]
        if token is None:
            self._base = ""
            return
        base = self._alone.get(token)
        if base is None:
            base = self._alone[token] = self._decode(self._anchor)
        self._base = base

    def add_token(self, token) -> bool:
        """Add one token id; True when its text (and any held back before it) was added to `text`."""
        token = int(token)
        self.tokens.append(token)
        self._pending.append(token)
        spelled = self._decode(self._anchor + self._pending)
        if not spelled.startswith(self._base) or spelled.endswith(REPLACEMENT):
            return False
        self.text += spelled[len(self._base):]
        self._pending = []
        self._set_anchor(token)
        return True

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


def _spellings(tokenizer) -> dict:
    """The text of each token decoded alone, remembered per tokenizer (an anchor's, asked once a token: a
    conversation's cached tokens are spelled one by one, two decodes each, on a thread that holds the GIL)."""
    try:
        return _alone.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: remembered for this detokenizer only
        return {}
