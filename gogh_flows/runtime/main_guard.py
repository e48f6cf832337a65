"""Refuse to start worker processes from a script that lacks ``if __name__ == "__main__":``.

Dask starts a worker process with multiprocessing's *spawn* method (its default, and what
dask-cuda uses): the new interpreter imports the main script again before it runs anything.
A script that opens a pool (or calls a ``@gogh_placed`` flow) at its top level then opens
it again inside every worker; multiprocessing stops that with its "bootstrapping phase"
RuntimeError, the worker never starts, and the parent was seen waiting more than seven
minutes for it on a real H100. The mistake is visible before anything is started: the
main module's top-level code is on the stack, at a line outside the guard. So this module
reads the script with :mod:`ast` and says so at once, with what to write instead.

It only inspects; it starts nothing and never guesses: when the main module has no file
(an interactive session, ``python -c``, a notebook), its file cannot be parsed, or the
start method is ``fork`` (the child does not re-import the script), it lets the start go on.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import textwrap
import threading
from dataclasses import dataclass
from types import FrameType

__all__ = [
    "KEEP_NOTE",
    "SKIP_ENV",
    "MainGuardMissing",
    "UnguardedCall",
    "check_main_guard",
    "guard_advice",
    "line_is_guarded",
    "unguarded_call",
]

#: set to 1 to skip the check (a script that keeps its workers from re-running it some other way)
SKIP_ENV = "GOGH_SKIP_MAIN_GUARD_CHECK"

#: said after the advice: what stays where it is
KEEP_NOTE = ("Imports, decorated flows and function definitions stay at the top level; only what runs "
             "them goes under the guard")

#: multiprocessing start methods whose children import the main module again
_REIMPORTING = ("spawn", "forkserver")


class MainGuardMissing(RuntimeError):
    """The pool would start worker processes from the main script's unguarded top level."""


@dataclass(frozen=True)
class UnguardedCall:
    """Where the main script's top level is when it asks for worker processes."""

    path: str
    line: int
    statement: str  # the top-level statement's source (what to move under the guard)


def _is_name_main(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "__name__"


def _is_main_literal(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value == "__main__"


def _guard_polarity(test: ast.expr) -> str | None:
    """``"body"`` if ``test`` being true means "run as a script", ``"orelse"`` if false does; else None.

    ``__name__ == "__main__"`` (either order), ``and``-ed with anything, guards the body;
    ``__name__ != "__main__"`` guards the ``else`` branch.
    """
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return "body" if any(_guard_polarity(v) == "body" for v in test.values) else None
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = test.left, test.comparators[0]
        if (_is_name_main(left) and _is_main_literal(right)) or (_is_main_literal(left) and _is_name_main(right)):
            if isinstance(test.ops[0], ast.Eq):
                return "body"
            if isinstance(test.ops[0], ast.NotEq):
                return "orelse"
    return None


def _spans(node: ast.stmt, line: int) -> bool:
    end = getattr(node, "end_lineno", None) or node.lineno
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return start <= line <= end


def _guarded_in(body: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` lies, within these statements, under a ``__main__`` guard's guarded branch."""
    for stmt in body:
        if not _spans(stmt, line):
            continue
        if isinstance(stmt, ast.If):
            polarity = _guard_polarity(stmt.test)
            for branch, part in (("body", stmt.body), ("orelse", stmt.orelse)):
                if any(_spans(s, line) for s in part):
                    return polarity == branch or _guarded_in(part, line)
            return False  # the line is in the test itself
        # compound statements (with, try, for, while, match): look inside their blocks
        blocks: list[list[ast.stmt]] = []
        for field in ("body", "orelse", "finalbody"):
            blocks.append(getattr(stmt, field, None) or [])
        blocks += [h.body for h in getattr(stmt, "handlers", [])]
        blocks += [c.body for c in getattr(stmt, "cases", [])]
        return any(_guarded_in(b, line) for b in blocks if b and isinstance(b[0], ast.stmt))
    return False


def line_is_guarded(source: str, line: int) -> bool:
    """Whether ``line`` of module ``source`` runs only when the module is the main script.

    True when the line lies in the guarded branch of an ``if __name__ == "__main__":``
    (or ``if "__main__" == __name__``, ``... and other``, the ``else`` of ``!=``) at any
    depth of the module's top-level blocks. Lines inside function or class bodies count
    as guarded only the same way: the caller's module frame is what decides at run time.
    """
    return _guarded_in(ast.parse(source).body, line)


def _statement_at(source: str, line: int) -> str:
    """The top-level statement of ``source`` that spans ``line`` (at most 6 lines of it)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    for stmt in tree.body:
        if _spans(stmt, line):
            text = ast.get_source_segment(source, stmt) or ""
            lines = text.splitlines()
            return "\n".join(lines[:6] + (["..."] if len(lines) > 6 else []))
    return ""


def _main_file() -> tuple[object, str] | None:
    """The main module and its file, when a spawned worker would import it again.

    multiprocessing does not re-run a package's ``__main__`` (``python -m pkg``, or a
    ``__main__.py`` run by path), so such a main needs no guard.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not path:
        return None
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__") or os.path.basename(path) == "__main__.py":
        return None
    return main, os.path.realpath(path)


def _module_frame(frame: FrameType | None, main: object, path: str) -> FrameType | None:
    """The frame running the main module's top-level code in this stack, if any."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and (
                frame.f_globals is getattr(main, "__dict__", None)
                or os.path.realpath(code.co_filename) == path):
            return frame
        frame = frame.f_back
    return None


def unguarded_call() -> UnguardedCall | None:
    """Where the main script's top level is, if it is at a line outside the ``__main__`` guard.

    The calling thread's stack is searched first, then the main thread's (a flow run may
    open the pool from a worker thread while the main thread waits at the script's call).
    ``None`` when the main module has no file, its top-level code is not running, the line
    is guarded, or the file cannot be read or parsed (nothing is guessed).
    """
    found = _main_file()
    if found is None:
        return None
    main, path = found
    frame = _module_frame(sys._getframe(1), main, path)
    if frame is None:
        main_ident = threading.main_thread().ident
        if main_ident is not None and main_ident != threading.get_ident():
            frame = _module_frame(sys._current_frames().get(main_ident), main, path)
    if frame is None:
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as fh:
            source = fh.read()
        if line_is_guarded(source, line):
            return None
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    statement = _statement_at(source, line) or linecache.getline(path, line).strip()
    return UnguardedCall(path=path, line=line, statement=statement)


def guard_advice(call: UnguardedCall | None = None) -> str:
    """What to write: the guard, wrapped around the caller's own statement when it is known."""
    body = textwrap.indent(call.statement, "    ") if call and call.statement else "    main()"
    return f'if __name__ == "__main__":\n{body}'



def _start_method() -> str:
    import dask

    return str(dask.config.get("distributed.worker.multiprocessing-method", "spawn") or "spawn")


def check_main_guard(what: str = "GPU worker processes") -> None:
    """Raise :class:`MainGuardMissing` if starting ``what`` now would re-run the main script.

    Cheap (one stack walk; the script is parsed only when its top level is on the stack)
    and precise: it fires only when the start method re-imports the script (Dask's
    ``distributed.worker.multiprocessing-method``, default ``spawn``) and the main
    script's top-level code is at a line outside an ``if __name__ == "__main__":`` block.
    ``GOGH_SKIP_MAIN_GUARD_CHECK=1`` turns it off.
    """
    if os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return
    method = _start_method()
    if method not in _REIMPORTING:
        return
    call = unguarded_call()
    if call is None:
        return
    raise MainGuardMissing(
        f"{call.path}, line {call.line}, starts {what} from the script's top level, outside an "
        f'`if __name__ == "__main__":` block. Dask starts each worker with multiprocessing\'s '
        f"{method!r} method, which imports this script again in the new process: without the guard "
        "every worker would run this line again and fail (\"An attempt has been made to start a new "
        "process before the current process has finished its bootstrapping phase\") while this "
        "process waits for it. Put the code that runs your flows or opens the pool under the guard:\n\n"
        f"{textwrap.indent(guard_advice(call), '    ')}\n\n"
        f"{KEEP_NOTE} (set {SKIP_ENV}=1 if the script keeps its workers from re-running it some other way)."
    )
