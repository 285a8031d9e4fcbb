"""A user's own code failing: their error, shown as theirs (controller/tasks/plugins.py loads it).

A reward, a factory, or what a factory made (an environment's `start`/`step`/`score`, a
trainer's methods) that raises is the user's error, not a defect of rolloutdb: exit 2,
their traceback printed (from their function down: it is their code, they need it), and
one last `error:` line naming the file:line of the last frame in their code. Which frames
are theirs: those under the directory of a plugin file, or the package of a plugin
module, that `plugins` registered when it imported them (`remember_user_code`), outside
rolloutdb's own source, the standard library and installed packages.
"""

from __future__ import annotations

import inspect
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any


class PluginError(ValueError):
    """A reward, environment or trainer by import path that cannot be used; one line."""


class UserCodeError(PluginError):
    """The user's own code (a reward, a factory, what a factory made) raised or returned
    something unusable: their error (exit 2), not a defect of rolloutdb. The message is one
    line naming their file:line; `user_traceback` is their traceback from their function
    down, which `rolloutdb` prints above that line (it is their code: they need it)."""

    def __init__(self, message: str, user_traceback: str | None = None):
        super().__init__(message)
        self.user_traceback = user_traceback


def one_line(text: object) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 160 else text[:157] + "..."


def safe_str(e: BaseException) -> str:
    try:
        return one_line(e)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises still gets reported
        return "(its message could not be printed)"


# Where the user's code lives: a file plugin's directory (its sibling modules are theirs
# too), a module plugin's top-level package directory or its single file. A failure whose
# traceback runs through one of these is the user's error, however deep in rolloutdb it
# surfaced (an environment or trainer a factory made fails mid-run: `user_error_from`).
USER_ROOTS: set[str] = set()
# The standard library and installed packages: never the user's, unless the plugin itself
# is installed there (then only its own package directory is).
_LIBS = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}))
_OUR_PACKAGES = ("rolloutdb", "rolloutdb.store", "rolloutdb.controller", "rolloutdb.gpu_capture",
                 "rolloutdb.migrations")


def _ours() -> tuple[str, ...]:
    """rolloutdb's own source directories (its subpackages are laid out side by side in a
    checkout): a plugin file put beside them does not make them the user's."""
    dirs = []
    for name in _OUR_PACKAGES:
        module = sys.modules.get(name)
        dirs += [str(Path(d).resolve()) for d in getattr(module, "__path__", [])]
    return tuple(dirs)


def remember_user_code(module: ModuleType, *, is_file: bool) -> None:
    file = getattr(module, "__file__", None)
    if not file:
        return
    path = Path(file).resolve()
    if is_file:
        USER_ROOTS.add(str(path.parent))
        return
    top = sys.modules.get((module.__package__ or "").split(".")[0]) if module.__package__ else None
    top_file = getattr(top, "__file__", None)
    USER_ROOTS.add(str(Path(top_file).resolve().parent) if top_file else str(path))


def _under(filename: str, roots: Sequence[str]) -> bool:
    return any(filename == root or filename.startswith(root.rstrip("/") + "/") for root in roots)


def _theirs(filename: str) -> bool:
    if _under(filename, _ours()):
        return False
    return any(_under(filename, [root]) and (_under(root, _LIBS) or not _under(filename, _LIBS))
               for root in USER_ROOTS)


def frames_of(tb: Any) -> list[Any]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


def where_theirs(frames: list[Any]) -> str:
    """'file:line (in function)' of the last frame in the user's code among `frames`
    (traceback entries from the user's function down)."""
    summary = [traceback.FrameSummary(f.tb_frame.f_code.co_filename, f.tb_lineno, f.tb_frame.f_code.co_name,
                                      lookup_line=False) for f in frames]
    pick = [s for s in summary if _theirs(s.filename)] or \
           [s for s in summary if not _under(s.filename, _LIBS + _ours())] or summary[:1]
    if not pick:
        return "(no Python frame)"
    last = pick[-1]
    return f"{last.filename}:{last.lineno} (in {last.name})"


def their_traceback(e: BaseException, frames: list[Any]) -> str:
    tb = frames[0] if frames else None
    return "".join(traceback.format_exception(type(e), e, tb)).rstrip("\n")


def user_code_raised(e: BaseException, what: str) -> UserCodeError:
    """`e` was raised by the user's function called from the frame that caught it: one
    line naming their file:line and `what` (the key and the record), their traceback
    kept for the CLI to print above it."""
    frames = frames_of(e.__traceback__)[1:]  # the first entry is our frame, the one that called theirs
    where = where_theirs(frames)
    return UserCodeError(f"{what} raised {type(e).__name__}: {safe_str(e)} at {where}; its traceback is above",
                         their_traceback(e, frames))


def defined_at(fn: Any) -> str:
    """'file:line' where the user's function is defined (a value it returned has no frame)."""
    code = getattr(inspect.unwrap(fn), "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else getattr(fn, "__qualname__", repr(fn))


def user_error_from(e: BaseException) -> UserCodeError | None:
    """The user's error when `e` (or an exception it was raised from) came out of the
    user's code: an environment's `start`/`step`/`score` or a trainer's method, called
    by the pumps mid-run. None when no frame of its traceback is theirs."""
    seen: set[int] = set()
    error: BaseException | None = e
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        frames = frames_of(error.__traceback__)
        first = next((i for i, f in enumerate(frames) if _theirs(f.tb_frame.f_code.co_filename)), None)
        if first is not None:
            caller = frames[first - 1].tb_frame.f_code.co_name if first else "?"
            return UserCodeError(f"your code raised {type(error).__name__}: {safe_str(error)} at "
                                 f"{where_theirs(frames[first:])}, called by rolloutdb's {caller}; "
                                 "its traceback is above", their_traceback(error, frames[first:]))
        error = error.__cause__  # not __context__: an error of ours raised while one of theirs was handled is ours
    return None
