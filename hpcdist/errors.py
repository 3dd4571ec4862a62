"""A command's refusal, the one shape every ``hpcdist`` command uses for bad input: ``CommandError`` carries the
line and the exit status, and ``hpcdist.cli`` prints it as ``hpcdist: <line>`` (its one error wrapper).
``refusing`` declares which library errors are a command's refusals, so a command body holds no try/except of its
own for them. Standard library only: every layer's command module may use it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

__all__ = ["CommandError", "refusing"]

F = TypeVar("F", bound=Callable[..., int])


class CommandError(Exception):
    """The command refuses: ``hpcdist: {message}`` on stderr, exit ``code``. A message of None exits with the code
    silently (a rank of ``hpcdist train`` whose rank 0 already said it)."""

    def __init__(self, message: str | None, code: int = 2) -> None:
        super().__init__(message or "")
        self.message = message
        self.code = code


def refusing(
    prefix: str, *errors: type[BaseException], passing: tuple[type[BaseException], ...] = ()
) -> Callable[[F], F]:
    """A command whose ``errors`` (raised anywhere in it) are bad input: each becomes ``CommandError(f"{prefix}:
    {e}")``. ``passing`` are subclasses of those that keep their own message (a ConfigError says which key)."""

    def wrap(command: F) -> F:
        @functools.wraps(command)
        def run(*args: object, **kwargs: object) -> int:
            try:
                return command(*args, **kwargs)
            except BrokenPipeError:
                raise  # the reader left (`| head`): not the input's fault, hpcdist.cli says nothing
            except passing:
                raise
            except errors as e:
                raise CommandError(f"{prefix}: {e}") from e

        return run  # type: ignore[return-value]

    return wrap
