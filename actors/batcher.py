"""BatcherActor: the single owner of the model, driving the engine's step loop.

Turns arrive as `Submit` messages; the actor answers each through the `reply`
callable that came with it (called on the batcher's thread with a `TurnResult`
or an exception carrying the turn id). It drives the engine with self-addressed
step messages, so new turns interleave with steps and the mailbox never waits
behind a busy loop; with no work it idles. The engine knows a turn by its id,
and ids are each agent's own: a turn whose id another agent's turn holds waits
until that one ends, or until its caller gives up (`Turn.abandoned`, asked at each
step as the engine asks its own turns): then it is dropped (`TurnAbandoned`), and the
turn it waited behind goes on. Stopping or crashing fails every queued, waiting and
in-flight turn, so no caller waits forever.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Callable

import pykka

from actors.supervisor import SupervisedActor
from runtime.engine import Engine, Turn, TurnAbandoned, TurnError


class BatcherStopped(TurnError):
    """The batcher stopped before the turn finished; resubmit to a new batcher."""


class BatcherCrashed(TurnError):
    """The batcher crashed while the turn was queued or running."""


@dataclass(frozen=True)
class Submit:
    """Message: run `turn`, then call `reply(TurnResult | TurnError)` on the batcher's thread."""

    turn: Turn
    reply: Callable


_STEP = object()
STATS = "stats"  # message: answer with a copy of the engine's EngineStats


@dataclass(frozen=True)
class Warmup:
    """Message: run `Engine.warmup(progress)` on the batcher's thread; answers the seconds it took."""

    progress: Callable | None = None


class BatcherActor(SupervisedActor):
    """The GPU owner. Its thread is the only one that runs the model.

    Construct with the loaded model, tokenizer and `ModelCacheSpec`; `supervisor`
    (optional) is told when it exits; the other keyword arguments go to `Engine`.
    """

    def __init__(self, model, tokenizer, spec, supervisor=None, **engine_options):
        super().__init__(supervisor)
        self.engine = Engine(model, tokenizer, spec, **engine_options)
        self.replies: dict[str, Callable] = {}
        self.deferred: dict[str, list] = {}  # turn id -> Submits of other agents' turns of that id, for after it
        self.step_queued = False

    def on_start(self):
        self.thread = threading.current_thread()  # see runtime.api.facade: waited for at shutdown
        self.engine.record_graphs()  # on this thread, whose stream the graphs are for

    def on_receive(self, message):
        if message is _STEP:
            self.step_queued = False
            self._drop_abandoned()
            for outcome in self.engine.step():
                self._reply(outcome)
            self._queue_step()
        elif isinstance(message, Submit):
            self._submit(message)
        elif message == STATS:
            return copy.deepcopy(self.engine.stats)
        elif isinstance(message, Warmup):
            return self.engine.warmup(message.progress)
        else:
            raise TypeError(f"BatcherActor got an unknown message {message!r}")

    def _submit(self, msg: Submit):
        turn_id = msg.turn.turn_id
        if turn_id in self.replies:  # turn ids are each agent's own: another agent's turn of this id runs after it
            self.deferred.setdefault(turn_id, []).append(msg)
            return
        try:
            self.engine.submit(msg.turn)
        except TurnError as e:
            msg.reply(e)
            self._next_deferred(turn_id)
            return
        self.replies[turn_id] = msg.reply
        self._queue_step()

    def _next_deferred(self, turn_id: str) -> None:
        """Submit the oldest turn that waits for turn id `turn_id` to be free, if any."""
        waiting = self.deferred.get(turn_id)
        if waiting and turn_id not in self.replies:
            msg = waiting.pop(0)
            if not waiting:
                del self.deferred[turn_id]
            self._submit(msg)

    def _drop_abandoned(self) -> None:
        """Answer `TurnAbandoned` to each turn waiting for its id to be free whose caller gave up meanwhile."""
        for turn_id, waiting in list(self.deferred.items()):
            kept = []
            for msg in waiting:
                if msg.turn.abandoned is not None and msg.turn.abandoned():
                    msg.reply(TurnAbandoned(turn_id, "its caller gave up while it waited for another agent's turn "
                                                     "of the same id"))
                else:
                    kept.append(msg)
            if kept:
                self.deferred[turn_id] = kept
            else:
                del self.deferred[turn_id]

    def _queue_step(self):
        if self.engine.has_work() and not self.step_queued:
            self.step_queued = True
            self.actor_ref.tell(_STEP)

    def _reply(self, outcome):
        reply = self.replies.pop(outcome.turn_id, None)
        if reply is not None:
            reply(outcome)
        self._next_deferred(outcome.turn_id)

    def on_stop(self):
        self._fail_everything(lambda tid: BatcherStopped(tid, "the batcher stopped"))

    def on_failure(self, exception_type, exception_value, traceback):
        why = f"the batcher crashed: {exception_type.__name__}: {exception_value}"
        self._fail_everything(lambda tid: BatcherCrashed(tid, why))

    def _fail_everything(self, make_error):
        deferred, self.deferred = [m for msgs in self.deferred.values() for m in msgs], {}
        for msg in deferred:
            msg.reply(make_error(msg.turn.turn_id))
        for e in self.engine.fail_all(make_error):
            self._reply(e)
        for msg in self.take_leftover(Submit):
            msg.reply(make_error(msg.turn.turn_id))


def submit(batcher: pykka.ActorRef, turn: Turn) -> pykka.Future:
    """Send `turn` to `batcher`; return a future of its `TurnResult`.

    The future raises the turn's `TurnError` (BatcherStopped if the batcher is
    gone). For use outside actors; an actor passes its own `reply` in `Submit`.
    """
    future = pykka.ThreadingFuture()

    def reply(outcome):
        if isinstance(outcome, BaseException):
            future.set_exception((type(outcome), outcome, outcome.__traceback__))
        else:
            future.set(outcome)

    try:
        batcher.tell(Submit(turn, reply))
    except pykka.ActorDeadError:
        reply(BatcherStopped(turn.turn_id, "the batcher is not running"))
    return future
