"""``tensor-exchange snapshot PID``: another process's registry, once, as one JSON object.

What ``tensor-exchange top PID`` shows, for scripts: the registry's ``stats()``, bytes per
device, holders by kind, pending releases per stream, the processes holding its memory,
the tensor sets it publishes or reads (``sets``, where it has loaded them), and the largest records with their origin, holders and age. The schema, every field with
its unit, is in docs/observability.md (``top`` section); ``schema`` in the object says
its version.

The process must serve inspection (``EXCHANGE_INSPECT=1`` in its environment, or
``tx.serve_inspection()`` in it) and belong to this user (root may inspect any process).
Exit status 0 with the object on stdout; 1 with a one-line reason on stderr (no such
process, not serving, another user's, too many clients, no answer within ``--timeout``);
2 for an option out of range.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .arguments import integer, interval, pid, seconds

__all__ = ["add_arguments", "main", "seconds", "interval", "pid", "indent"]

#: The widest --indent.
MAX_INDENT = 64


def _clean(message: object) -> str:
    """An error message as one line a terminal shows as it is (it may quote the process)."""
    from ..inspection import safe_text

    return safe_text(message)


#: argparse type of --indent: spaces, 0 to MAX_INDENT.
indent = integer(0, MAX_INDENT)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..inspection import MAX_ROWS

    parser.add_argument("pid", type=pid, help="the process to inspect (it must serve: EXCHANGE_INSPECT=1)")
    parser.add_argument("--rows", type=int, default=20, metavar="N",
                        help=f"largest records to list, 0 to {MAX_ROWS} (default 20; 0: no scan of the records)")
    parser.add_argument("--timeout", type=seconds, default=5.0, metavar="S",
                        help="seconds to wait for the process's answer (default 5; at most 3600)")
    parser.add_argument("--indent", type=indent, default=None, metavar="N",
                        help=f"indent the JSON by N spaces, 0 to {MAX_INDENT} (default: one line)")


def main(args: argparse.Namespace) -> int:
    from ..errors import ExchangeError
    from ..inspection import MAX_ROWS, MAX_TIMEOUT_S, query

    if not 0 <= args.rows <= MAX_ROWS:
        print(f"tensor-exchange snapshot: --rows must be in [0, {MAX_ROWS}], got {args.rows}", file=sys.stderr)
        return 2
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        print(f"tensor-exchange snapshot: --timeout must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, "
              f"got {args.timeout}", file=sys.stderr)
        return 2
    if args.indent is not None and not 0 <= args.indent <= MAX_INDENT:
        print(f"tensor-exchange snapshot: --indent must be in [0, {MAX_INDENT}], got {args.indent}", file=sys.stderr)
        return 2
    try:
        reply = query(args.pid, rows=args.rows, timeout=args.timeout)
    except (OSError, ExchangeError, ValueError, TypeError) as exc:
        print(f"tensor-exchange snapshot: {_clean(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=args.indent))
    return 0
