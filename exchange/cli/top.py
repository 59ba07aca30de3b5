"""``tensor-exchange top PID``: a live terminal view of another process's registry.

Shows, refreshed about once a second (``--interval``): live records and bytes per device,
holders by kind, pending releases per stream, the processes holding its memory, and the
largest records with their origin, holders and age (from a scan the watched process
makes at most once every 5 s; its age is shown). ``q`` quits (Ctrl-C too); the terminal
is put in cbreak mode while it runs and restored on the way out.

The process must serve inspection (``EXCHANGE_INSPECT=1`` in its environment, or
``tx.serve_inspection()`` in it) and belong to this user (root may inspect any process).
Needs ``rich`` (``pip install rich``, or the ``top`` extra) and a terminal;
``tensor-exchange snapshot PID`` prints the same data once as JSON. Exit status 0 on
``q``; 1 with a one-line reason (no such process, not serving, another user's, too many
clients, the process ended, a reply it cannot show: whatever a server sends, never a
traceback); 2 for an option out of range.

Everything the watched process sends, and its command line from /proc, is shown with its
control characters escaped (``\\x1b`` for ESC: ``exchange.inspection.safe_text``), whatever
its server did: a label or a name cannot move the cursor, retitle the window or clear
the screen. The server drops a connection that sends no request for 5 s; with an
``--interval`` over 2.5 s, or after one such drop (top was stopped, say), top connects
again.
"""

from __future__ import annotations

import argparse
import math
import os
import select
import signal
import sys
import time
from typing import Any

__all__ = ["add_arguments", "main", "render"]

#: Keys that quit: q, Q, Ctrl-C (when the terminal delivers it as a byte).
QUIT_KEYS = (b"q", b"Q", b"\x03")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..inspection import MAX_ROWS
    from .snapshot import interval, pid, seconds

    parser.add_argument("pid", type=pid, help="the process to watch (it must serve: EXCHANGE_INSPECT=1)")
    parser.add_argument("--interval", type=interval, default=1.0, metavar="S",
                        help="seconds between refreshes (default 1; at least 0.2, at most 3600)")
    parser.add_argument("--rows", type=int, default=10, metavar="N",
                        help=f"largest records to show, 0 to {MAX_ROWS} (default 10)")
    parser.add_argument("--timeout", type=seconds, default=5.0, metavar="S",
                        help="seconds to wait for each answer of the process (default 5; at most 3600)")


def _bytes(n: int) -> str:
    """``n`` bytes with its size in the largest unit it reaches (``"4,194,304 (4.0 MiB)"``);
    integer arithmetic only, so no int is too large for it."""
    text = f"{n:,}"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            tenths = (n * 10 + size // 2) // size  # rounded to a tenth of the unit
            return f"{text} ({tenths // 10:,}.{tenths % 10} {unit})"
    return text


def _age(low: float, high: float) -> str:
    if high - low <= max(0.5, 0.1 * low):
        return f"{low:.1f} s"
    return f"{low:.1f}-{high:.1f} s"


def _plain(*cells: object) -> list[Any]:
    """Table cells as plain text: what the watched process sends is never read as rich markup."""
    from rich.text import Text

    return [Text(str(c)) for c in cells]


def _cmdline(pid: int) -> str:
    """Process ``pid``'s command line, its control characters escaped (it is the watched
    process's to choose), cut at 60 characters."""
    from ..inspection import safe_text

    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            text = fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
    text = " ".join(safe_text(text).split())
    return text if len(text) <= 60 else text[:57] + "..."


def render(reply: dict[str, Any], interval: float = 1.0, command: str = "") -> Any:
    """The screen for one reply of ``exchange.inspection`` (a rich renderable). Every
    string in ``reply``, and ``command``, is shown with its control characters escaped
    (``exchange.inspection.safe_text``), whoever made the reply."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ..inspection import safe_reply, safe_text

    reply = safe_reply(reply)
    command = safe_text(command)
    s = reply["stats"]
    head = Text()
    head.append("tensor-exchange top", style="bold")
    head.append(f"  pid {reply['pid']}")
    if command:
        head.append(f"  {command}", style="dim")
    head.append(f"  up {reply['uptime_s']:.1f} s  {reply['path']} path  every {interval:g} s  q quits")
    total = sum(s["live_bytes"].values())
    summary = Text(f"live records {s['live_records']:,}  live bytes {total:,}  "
                   f"exports {s['exports_outstanding']:,}  imports {s['imports_outstanding']:,}  "
                   f"pending releases {s['pending_releases']:,}  made {s['created_total']:,}  "
                   f"released {s['released_total']:,}")

    scan = reply.get("scan")
    per_device = scan["records_by_device"] if scan else {}
    devices = Table(title="Memory by device", title_justify="left", expand=False)
    for col in ("device", "live bytes", "pending bytes", "records (scan)"):
        devices.add_column(col, justify="left" if col == "device" else "right")
    names = [d["device"] for d in reply["devices"]] + [d for d in per_device if d not in
                                                       {x["device"] for x in reply["devices"]}]
    rows = {d["device"]: d for d in reply["devices"]}
    for name in names:
        d = rows.get(name, {"live_bytes": 0, "pending_bytes": 0})
        devices.add_row(*_plain(name, _bytes(d["live_bytes"]), _bytes(d["pending_bytes"]),
                        f"{per_device[name]:,}" if name in per_device else "-"))
    if not names:
        devices.add_row(*_plain("(none)", "0", "0", "-"))

    h = reply["holders"]
    holders = Table(title="Holders by kind", title_justify="left")
    holders.add_column("kind")
    holders.add_column("holders", justify="right")
    holders.add_row(*_plain("tensors and views (scan)", "-" if h.get("tensors") is None else f"{h['tensors']:,}"))
    holders.add_row(*_plain("DLPack exports", f"{h['exports']:,}"))
    holders.add_row(*_plain("other processes", f"{h['remote_processes']:,}"))
    holders.add_row(*_plain("handles in transit", f"{h['leases']:,}"))

    streams = Table(title=f"Pending releases by stream ({s['pending_releases']:,})", title_justify="left")
    for col in ("stream", "device", "releases"):
        streams.add_column(col, justify="right" if col == "releases" else "left")
    for row in reply["pending_streams"]:
        streams.add_row(*_plain(row["stream"], row["device"], f"{row['releases']:,}"))
    if reply.get("pending_streams_more"):
        streams.add_row(*_plain(f"... {reply['pending_streams_more']} more streams", "", ""))
    if not reply["pending_streams"]:
        streams.add_row(*_plain("(none)", "", "0"))

    remote = Table(title=f"Remote holders by process ({s['remote_holders']:,})", title_justify="left")
    for col in ("pid", "records", "bytes", "mappings"):
        remote.add_column(col, justify="right")
    for row in reply["remote_processes"]:
        remote.add_row(*_plain(str(row["pid"]), f"{row['records']:,}", _bytes(row["bytes"]), f"{row['mappings']:,}"))
    if reply.get("remote_processes_more"):
        remote.add_row(*_plain(f"... {reply['remote_processes_more']} more", "", "", ""))
    if not reply["remote_processes"]:
        remote.add_row(*_plain("(none)", "", "", ""))

    if scan:
        title = (f"Largest records (scan {scan['age_s']:.1f} s old, {scan['records']:,} records, "
                 f"took {scan['took_ms']:.1f} ms; at most every {scan['interval_s']:g} s)")
    else:
        title = "Largest records (no scan yet)"
    largest = Table(title=title, title_justify="left")
    for col in ("record", "device", "bytes", "kind", "origin", "holders", "age"):
        largest.add_column(col, justify="right" if col in ("record", "bytes", "age") else "left",
                           overflow="ellipsis", no_wrap=col in ("origin", "holders"))
    for row in (scan or {}).get("largest", []):
        who = ", ".join(row["holders"])
        if row["holders_count"] > len(row["holders"]):
            who += f" (+{row['holders_count'] - len(row['holders'])})"
        origin = row["origin"] + (f" [{row['label']}]" if row.get("label") else "")
        largest.add_row(*_plain(f"#{row['id']}", row["device"], _bytes(row["nbytes"]), row["kind"], origin,
                        who or "(none)", _age(row["age_s"], row["age_max_s"])))
    cost = Text(f"cost to the watched process: {reply['reply_ms']:.2f} ms for this reply"
                + (f", {scan['took_ms']:.1f} ms per scan" if scan else ""), style="dim")
    top = Table.grid(padding=(0, 2))
    top.add_row(devices, holders)
    mid = Table.grid(padding=(0, 2))
    mid.add_row(streams, remote)
    return Group(head, summary, Text(""), top, mid, largest, cost)


def main(args: argparse.Namespace) -> int:
    from ..errors import ExchangeError
    from ..inspection import IDLE_S, MAX_ROWS, MAX_TIMEOUT_S, InspectionClient, InspectionError, _Dropped, safe_text

    def fail(message: object, status: int = 1) -> int:
        print(f"tensor-exchange top: {safe_text(message)}", file=sys.stderr)
        return status

    if not 0 <= args.rows <= MAX_ROWS:
        return fail(f"--rows must be in [0, {MAX_ROWS}], got {args.rows}", 2)
    if not (math.isfinite(args.interval) and 0.2 <= args.interval <= MAX_TIMEOUT_S):
        return fail(f"--interval must be at least 0.2 and at most {MAX_TIMEOUT_S:g} seconds, got {args.interval}", 2)
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        return fail(f"--timeout must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {args.timeout}", 2)
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        return fail("needs the rich package: pip install rich (or pip install 'tensor-exchange[top]'); "
                    "tensor-exchange snapshot PID prints the same data as JSON without it")
    import termios
    import tty

    try:
        client = InspectionClient(args.pid, timeout=args.timeout)
    except (OSError, ExchangeError, ValueError) as exc:
        return fail(exc)
    start = client.process_start
    reconnect_each = args.interval > IDLE_S / 2  # the server would drop the connection between refreshes

    def reopen() -> None:
        """A new connection, to the same process (its start time: not a later one given its pid)."""
        nonlocal client
        client.close()
        try:
            client = InspectionClient(args.pid, timeout=args.timeout)
        except ProcessLookupError:
            raise InspectionError(f"process {args.pid} ended") from None
        if None not in (start, client.process_start) and client.process_start != start:
            raise InspectionError(f"process {args.pid} ended")

    def ask() -> dict[str, Any]:
        """One reply; once more on a new connection when the server dropped this one while
        the process runs (idle: top was stopped, say)."""
        try:
            return client.request(args.rows)
        except _Dropped:
            reopen()
        return client.request(args.rows)

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        client.close()
        return fail("needs a terminal on stdin and stdout; tensor-exchange snapshot PID prints the same data "
                    "once as JSON")
    try:
        reply = ask()
    except (OSError, ExchangeError, ValueError) as exc:
        client.close()
        return fail(exc)
    command = _cmdline(args.pid)
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    handlers = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):  # leave the terminal as it was on these too
        handlers[sig] = signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    # Ctrl-C quits even where top was started with SIGINT ignored (a background job of a
    # shell without job control: Python then installs no KeyboardInterrupt handler).
    handlers[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    def draw(reply: dict[str, Any]) -> Any:
        """The screen for ``reply``; InspectionError (one line) for a reply of the right form
        that cannot be drawn (a string where a number goes, say): a server is not trusted."""
        try:
            return render(reply, args.interval, command)
        except Exception as exc:
            raise InspectionError(f"process {args.pid} sent a reply this top cannot show "
                                  f"({type(exc).__name__}: {safe_text(exc)[:200]})") from None

    try:
        tty.setcbreak(fd)
        with Live(draw(reply), console=Console(), screen=True, auto_refresh=False,
                  redirect_stdout=False, redirect_stderr=False) as live:
            while True:
                deadline = time.monotonic() + args.interval
                while (left := deadline - time.monotonic()) > 0:
                    ready, _, _ = select.select([fd], [], [], left)
                    if ready:
                        keys = os.read(fd, 64)
                        if not keys or any(k in keys for k in QUIT_KEYS):
                            return 0
                if reconnect_each:
                    reopen()
                reply = ask()
                live.update(draw(reply), refresh=True)
    except KeyboardInterrupt:
        return 0
    except (OSError, ExchangeError, ValueError) as exc:
        return fail(exc)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        client.close()
