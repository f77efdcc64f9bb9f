"""Every use of pykka's private API, in one module.

Supervision (`actors.supervisor`) runs its own actor loop so that every failure is
contained and reported, and stopping actors answer the tells left in their inbox.
pykka has no public API for either, so these functions reach into pykka 4.5's
internals: the thread's target `Actor._actor_loop`, the dispatch of one message
`Actor._handle_receive`, the inbox teardown `Actor._actor_loop_teardown`, the
immediate stop `Actor._stop`, the inbox itself (a `queue.Queue` of envelopes with
`message` and `reply_to`), and a ref's `_actor_weakref` (for tests). Nothing else
in kvactors, its tests included, touches pykka's private names.

`check()` runs at import and raises ImportError naming the installed pykka version
when one of those internals is gone; `tests/test_pykka_compat.py` pins what each
function does against the installed pykka, and fails naming its version when that
changes. Upgrade pykka only with both passing.
"""

from __future__ import annotations

import importlib.metadata
import queue
from typing import Any

import pykka
from pykka import ActorRegistry

PYKKA_VERSION = importlib.metadata.version("pykka")
_INTERNALS = ("_actor_loop", "_actor_loop_teardown", "_handle_receive", "_stop")


def check() -> None:
    """Raise ImportError unless the installed pykka has the internals this module uses."""
    missing = [name for name in _INTERNALS if not callable(getattr(pykka.Actor, name, None))]
    if missing:
        raise ImportError(
            f"kvactors' actors build on pykka 4.5's actor loop ({', '.join(_INTERNALS)}); installed pykka "
            f"{PYKKA_VERSION} lacks {', '.join(missing)}: install pykka>=4.5,<5"
        )


check()


class OwnLoopActor(pykka.ThreadingActor):
    """A `pykka.ThreadingActor` whose thread runs `actor_loop()` in place of pykka's loop.

    pykka's loop calls `on_start`, then handles messages until the actor stops, then
    answers what is left in the inbox; `actor_loop` must do all of that itself, with
    `next_message`, `handle` and `teardown`. It runs on the actor's own thread, which
    ends when it returns.
    """

    def _actor_loop(self) -> None:  # pykka's thread target
        self.actor_loop()

    def actor_loop(self) -> None:
        """The whole life of the actor on its thread; subclasses define it."""
        raise NotImplementedError


def next_message(actor: pykka.Actor) -> tuple[Any, pykka.Future | None]:
    """Wait for the next envelope in `actor`'s inbox; return (message, future to reply to, None for a tell)."""
    envelope = actor.actor_inbox.get()
    return envelope.message, envelope.reply_to


def handle(actor: pykka.Actor, message: Any) -> Any:
    """Handle one `message` as pykka would, on the actor's thread; return the reply.

    pykka's own messages are served here (a stop request runs `stop_now`, proxy
    calls and attribute access run on the actor), anything else goes to `on_receive`.
    Exceptions propagate to the caller.
    """
    return actor._handle_receive(message)  # noqa: SLF001


def teardown(actor: pykka.Actor) -> None:
    """Answer what is left in a stopped `actor`'s inbox, as pykka does when its loop ends.

    Queued asks get `ActorDeadError` (a queued stop request gets None); queued tells
    are dropped without a word (take them first with `take_tells`).
    """
    actor._actor_loop_teardown()  # noqa: SLF001


def stop_now(actor: pykka.Actor) -> None:
    """Stop `actor` from its own thread now, skipping the rest of its inbox.

    It is unregistered, `actor_stopped` is set and `on_stop` runs (an `Exception`
    from it is logged); its loop ends after the message it is handling.
    """
    actor._stop()  # noqa: SLF001


def mark_stopped(actor: pykka.Actor) -> None:
    """Unregister `actor` and set its `actor_stopped`, without running `on_stop` (unlike `stop_now`)."""
    ActorRegistry.unregister(actor.actor_ref)
    actor.actor_stopped.set()


def take_tells(actor: pykka.Actor, types: tuple[type, ...]) -> list:
    """Remove and return, in order, the queued tells (not asks) in `actor`'s inbox whose message is one of `types`.

    Every other envelope goes back, in its order (a message sent meanwhile may land
    before them). Call it on the actor's own thread, where nothing else takes from the inbox.
    """
    taken, others = [], []
    while True:
        try:
            envelope = actor.actor_inbox.get_nowait()
        except queue.Empty:
            break
        if envelope.reply_to is None and isinstance(envelope.message, types):
            taken.append(envelope.message)
        else:
            others.append(envelope)
    for envelope in others:
        actor.actor_inbox.put(envelope)
    return taken


def inbox_empty(actor: pykka.Actor) -> bool:
    """Whether `actor`'s inbox holds no message now."""
    return actor.actor_inbox.empty()


def queued(actor: pykka.Actor | pykka.ActorRef) -> int:
    """How many messages wait in the inbox of `actor` (an actor or its ref) now; approximate while others send."""
    return actor.actor_inbox.qsize()


def actor_of(ref: pykka.ActorRef) -> pykka.Actor | None:
    """The actor object behind `ref`, None once it is gone.

    For tests and inspection: its state belongs to its own thread, so read it only
    while that thread cannot change it.
    """
    return ref._actor_weakref()  # noqa: SLF001
