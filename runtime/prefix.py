"""Character-level prefix matching between the text an agent's cache holds and its new prompt.

An agent renders its whole conversation with the chat template each turn and compares
the result with the text its cached tokens spell (`CacheMeta.text`). Comparing text,
not token ids, matters: tokenizers are not compositional (tokenize(a + b) is often not
tokenize(a) + tokenize(b)), so re-tokenizing the new prompt and comparing ids misses
reuse that is there. The outcomes:

- EXACT: the texts are identical. Keep all cached tokens but the last and feed that
  one again (its logits are needed to sample the next token).
- EXTEND: the cached text is a prefix of the new one. Keep everything; tokenize only
  the new suffix, with no special tokens added.
- DIVERGE: the common prefix is at least `threshold` (default 0.8) of the cached text.
  Cut the cache back to the last token boundary inside the common prefix and prefill
  the rest of the new text from there. When the new text ends exactly at that
  boundary (a client resends a conversation without the reply it got, to have it
  answered again), nothing would be left to feed: keep one token less and feed that
  one again, as EXACT does.
- COLD: anything else; start over from the whole new text.

Cuts happen only at token boundaries recorded in the metadata: `token_ends[i]` is the
character offset where token i's text ends, -1 where it ends inside a character.

Equal characters are not always equal tokens: message text is tokenized as text and the
chat template's as special tokens (`runtime.chat`), so a message that spells the
template's markers renders the very characters of another conversation's turns. Where
both the cache and the new text say where their message texts lie (`spans`), the texts
count as equal only up to the first place where those segments differ (`first_split`):
what follows is treated as a divergence there.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.detok import AnchoredDetokenizer

EXACT, EXTEND, DIVERGE, COLD = "exact", "extend", "diverge", "cold"
DEFAULT_THRESHOLD = 0.8


@dataclass(frozen=True)
class Match:
    """What to reuse: keep `keep` cached tokens, feed `refeed` token ids, then tokenize `suffix`.

    `suffix` is `new_text[start:]`; tokenize it with no special tokens added. The
    cache after this turn spells `new_text[:start]` + the suffix (+ whatever is generated).
    """

    kind: str
    keep: int
    start: int
    suffix: str
    refeed: tuple = ()


def common_prefix_len(a, b) -> int:
    """Length of the longest common prefix of sequences `a` and `b` (strs or lists; binary search over C-speed
    slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def last_boundary(token_ends, limit: int) -> int:
    """The largest k such that token k-1 ends at a recorded offset <= `limit` (0 if none)."""
    for k in range(len(token_ends), 0, -1):
        if 0 <= token_ends[k - 1] <= limit:
            return k
    return 0


def segment_start(spans, at: int, end: int) -> int:
    """Where a cut at offset `at` of a rendered text (of length `end`, message texts at `spans`) must move back to
    so that what follows it is tokenized as a cold turn tokenizes it, one whole segment (a message's text, or the
    template's text between two) at a time: the start of the message text that `at` lies in or ends (the old text
    went on past it), or of the template text it lies inside; `at` itself at a message's start or at the end."""
    before = 0
    for a, b in spans:
        if at <= a:
            return at if at == a else before
        if at <= b:
            return a
        before = b
    return at if at == end else before


def first_split(held_spans, spans, limit: int, end: int) -> int | None:
    """The first offset up to `limit` where a cached text (message texts at `held_spans`) and a new one (of length
    `end`, message texts at `spans`) that agree on their characters up to there do not both start or end a
    segment (a message text, or the template's text between two; the new text's end ends one), or None where
    their segments agree (or either's spans are not known: None or empty)."""
    if not held_spans or not spans:
        return None
    new = {x for s in spans for x in s if x <= limit} | ({end} if end <= limit else set())
    differ = {x for s in held_spans for x in s if x <= limit} ^ new
    return min(differ - {end}, default=None)


def last_shared(spans, at: int) -> int:
    """The last segment start before offset `at` (a message text's start or end in `spans`, or 0): where segments
    that agree up to `at` can be cut so that what follows is tokenized as a cold turn tokenizes it."""
    return max([0, *(x for s in spans for x in s if x < at)])


def match_prefix(cached_text: str, token_ids, token_ends, new_text: str, threshold: float = DEFAULT_THRESHOLD,
                 spans=None, held_spans=None) -> Match:
    """Decide how much of a cache (`token_ids` spelling `cached_text`) serves `new_text`.

    Returns a `Match` of kind EXACT, EXTEND, DIVERGE or COLD (see the module doc).
    `token_ends` is as in `CacheMeta`; a cache whose last token does not end exactly at
    the end of `cached_text` is only reused up to its last recorded boundary. With `spans` (where the message
    texts lie in `new_text`, `chat.Rendered.spans`), a cut where the texts differ goes back to the start of the
    segment it falls in (`segment_start`): the cached tokens of a message the new text changed were split as
    the old text was, not as the new one is. With `held_spans` too (those of `cached_text`), texts whose
    segments differ (`first_split`) are cut back to the last segment start before the difference (`last_shared`):
    a message that spells the template's markers never reuses cached markers, nor the other way round.
    """
    n = len(token_ids)
    if len(token_ends) != n:
        raise ValueError(f"{n} token ids but {len(token_ends)} token ends")
    cold = Match(COLD, 0, 0, new_text)
    if n == 0 or not cached_text:
        return cold
    whole = token_ends[-1] == len(cached_text)
    extends = new_text.startswith(cached_text)
    common = len(cached_text) if extends else common_prefix_len(cached_text, new_text)
    split = first_split(held_spans, spans, common, len(new_text))
    if whole and split is None and new_text == cached_text:
        return Match(EXACT, n - 1, len(new_text), "", (int(token_ids[-1]),))
    if whole and split is None and extends:
        return Match(EXTEND, n, len(cached_text), new_text[len(cached_text) :])
    if common < threshold * len(cached_text):
        return cold
    limit = common
    if spans and common < len(cached_text):
        limit = segment_start(spans, common, len(new_text))
    if split is not None:
        limit = min(limit, last_shared(spans, split))
    keep = last_boundary(token_ends, limit)
    if keep == 0:
        return cold
    start = token_ends[keep - 1]
    if start == len(new_text):  # nothing new to feed, but the next token needs the last one's logits
        return Match(DIVERGE, keep - 1, start, "", (int(token_ids[keep - 1]),))
    return Match(DIVERGE, keep, start, new_text[start:])


def token_ends(tokenizer, token_ids, start: int = 0, previous: int | None = None) -> list[int]:
    """Character end offsets of `token_ids` (for `CacheMeta.token_ends`), their text starting at `start`.

    Decodes each token after an anchor token (`previous`: the cached token just before
    them, if any) so tokenizers that strip a leading space decode consistently; the
    engine spells replies with the same rule (`runtime.detok`), so the ends of
    generated tokens are offsets into the reply's text. A
    token whose text ends inside a character (a byte-level piece completed later) gets
    -1. Valid when `tokenizer.decode` reproduces the text the tokens came from; check
    `tokenizer.decode(ids) == text` if unsure.
    """
    stream = AnchoredDetokenizer(tokenizer, previous)
    stream.expect(token_ids)  # one call to the tokenizer for all the tokens, where it allows
    return stream.add_tokens(token_ids, start)
