"""``tensor-exchange snapshot PID``: another process's registry, once, as one JSON object.

What ``tensor-exchange top PID`` shows, for scripts: the registry's ``stats()``, bytes per
device, holders by kind, pending releases per stream, the processes holding its memory,
and the largest records with their origin, holders and age. The schema, every field with
its unit, is in docs/observability.md (``top`` section); ``schema`` in the object says
its version.

The process must serve inspection (``EXCHANGE_INSPECT=1`` in its environment, or
``tx.serve_inspection()`` in it) and belong to this user (root may inspect any process).
Exit status 0 with the object on stdout; 1 with a one-line reason on stderr (no such
process, not serving, another user's, no answer within ``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..inspection import MAX_ROWS

    parser.add_argument("pid", type=int, help="the process to inspect (it must serve: EXCHANGE_INSPECT=1)")
    parser.add_argument("--rows", type=int, default=20, metavar="N",
                        help=f"largest records to list, 0 to {MAX_ROWS} (default 20; 0: no scan of the records)")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="S",
                        help="seconds to wait for the process's answer (default 5)")
    parser.add_argument("--indent", type=int, default=None, metavar="N",
                        help="indent the JSON by N spaces (default: one line)")


def main(args: argparse.Namespace) -> int:
    from ..errors import ExchangeError
    from ..inspection import MAX_ROWS, query

    if not 0 <= args.rows <= MAX_ROWS:
        print(f"tensor-exchange snapshot: --rows must be in [0, {MAX_ROWS}], got {args.rows}", file=sys.stderr)
        return 2
    if not args.timeout > 0:
        print(f"tensor-exchange snapshot: --timeout must be > 0 seconds, got {args.timeout}", file=sys.stderr)
        return 2
    try:
        reply = query(args.pid, rows=args.rows, timeout=args.timeout)
    except (OSError, ExchangeError, ValueError) as exc:
        print(f"tensor-exchange snapshot: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=args.indent))
    return 0
