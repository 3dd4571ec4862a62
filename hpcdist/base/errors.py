"""A command's refusal, the one shape every ``hpcdist`` command uses for bad input: ``CommandError`` carries the
line and the exit status, and ``hpcdist.cli`` prints it as ``hpcdist: <line>`` (its one error wrapper).
``refusing`` declares which library errors are a command's refusals, so a command body holds no try/except of its
own for them. Standard library only: every layer's command module may use it."""

from __future__ import annotations

import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import TypeVar

__all__ = ["CommandError", "LaunchError", "PeerRankDied", "keep_traceback", "refusing"]

F = TypeVar("F", bound=Callable[..., int])


class LaunchError(RuntimeError):
    """Submission failed (no executor, sbatch refused the job, a code snapshot refused) or a job ended without a
    result. Here, not in hpcdist.launch.submit: the snapshot that submit imports raises it too."""


class PeerRankDied(RuntimeError):
    """A collective of this rank failed because another rank is gone (its process died, its node was lost: gloo's
    or NCCL's connection reset / closed) or stopped answering (a collective timeout). Nothing is wrong with this
    rank: the attempt failed and is restartable (``EXIT_CODE`` 1, the status the attempt loop restarts on); the
    failure record, ``collective``, blames nobody (the dead rank's own record or its supervisor's says who). The
    original error is its ``__cause__``."""

    EXIT_CODE = 1
    failure_kind = "collective"


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


def keep_traceback(e: BaseException, run_dir: str | None) -> str:
    """An error no rule foresaw, in one line: its type and message (300 characters at most) and where its
    traceback went, a file in ``run_dir`` when that directory exists (it stays with the run), else a new private
    temp file."""
    text = "".join(traceback.format_exception(e))
    try:
        where = _write_traceback(text, run_dir)
    except OSError as err:  # even the temp directory refused: say so, still in one line
        where = f"nowhere: writing it failed ({err.strerror})"
    what = " ".join(f"{type(e).__name__}: {e}".split())
    if len(what) > 300:
        what = f"{what[:300]}..."
    return f"{what} (the traceback is in {where}; please report it)"


def _write_traceback(text: str, run_dir: str | None) -> str:
    from hpcdist.base.atomic import atomic_write
    from hpcdist.base.rundir import RunDir

    target = RunDir(run_dir or ".").error_log(time.strftime("%Y%m%d-%H%M%S"), os.getpid())
    name = target.name
    if run_dir and os.path.isdir(run_dir):
        try:
            return str(atomic_write(target, text))
        except OSError:
            pass  # a read-only or full run.dir: the temp file below
    fd, path = tempfile.mkstemp(prefix=name.removesuffix(".log") + "-", suffix=".log")  # O_EXCL, mode 0600
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path
