"""The root of kvactors' errors: `KvactorsError`.

Every error the API raises derives from `KvactorsError` and also keeps the builtin
base that says what kind of problem it is (`ValueError` for a bad argument, `OSError`
for a file, `RuntimeError` for a state, `KeyError` for a missing name), so
`except KvactorsError` catches every one of them and `except ValueError` still catches
the bad arguments. Every error type kvactors defines is importable from `runtime`.
A bad argument without an error of its own raises `InvalidArgument` (a `ValueError`)
or, for a wrong type, `InvalidArgumentType` (a `TypeError`).

This module imports nothing: any module may import it without an import cycle. `shown` formats a bad
argument for a message.
"""


class KvactorsError(Exception):
    """Base class of every error kvactors defines; catch it to handle all of them."""


class InvalidArgument(KvactorsError, ValueError):
    """An argument out of range or malformed; the message names it and what it accepts."""


class InvalidArgumentType(KvactorsError, TypeError):
    """An argument of the wrong type; the message names it and the types it accepts."""


class AdvisedError(KvactorsError):
    """An error whose message ends in `advice` on what to call next: `detail` is the message without it (an HTTP
    server words its own), `turn_id` the turn it is about, whose id then starts the message (None: none)."""

    def __init__(self, message: str, advice: str = "", turn_id: str | None = None):
        super().__init__(f"turn {turn_id}: {message}{advice}" if turn_id else f"{message}{advice}")
        self.detail, self.advice, self.turn_id = message, advice, turn_id


def shown(value) -> str:
    """`value` as an error message shows it: its repr, but an int of more than 40 digits by its digit count (Python
    refuses to turn an int of more than 4,300 digits into text at all)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value).bit_length() > 132:
        return f"an int of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    return repr(value)
