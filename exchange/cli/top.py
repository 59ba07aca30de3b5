"""``tensor-exchange top PID``: a live terminal view of another process's registry.

Shows, refreshed about once a second (``--interval``): live records and bytes per device,
holders by kind, pending releases per stream, the processes holding its memory, the
tensor sets it publishes or reads (``tx.publish`` / ``tx.subscribe``: newest version, its
bytes, readers, live versions; only where it has loaded sets), and the largest records
with their origin, holders and age (from a scan the watched process makes at most once
every 5 s; its age is shown). ``q`` quits (Ctrl-C too); the terminal
is put in cbreak mode while it runs and restored on the way out. Laid out for the
terminal's width at each refresh (asked of the terminal, whatever COLUMNS says): from 80
columns no number is cut, narrower some columns are left out, never a number cut
(``render``); every number of a reply is checked before it is shown.

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
    from .arguments import interval, pid, seconds

    parser.add_argument("pid", type=pid, help="the process to watch (it must serve: EXCHANGE_INSPECT=1)")
    parser.add_argument("--interval", type=interval, default=1.0, metavar="S",
                        help="seconds between refreshes (default 1; at least 0.2, at most 3600)")
    parser.add_argument("--rows", type=int, default=10, metavar="N",
                        help=f"largest records to show, 0 to {MAX_ROWS} (default 10)")
    parser.add_argument("--timeout", type=seconds, default=5.0, metavar="S",
                        help="seconds to wait for each answer of the process (default 5; at most 3600)")


def _size(n: int) -> str:
    """``n`` bytes in the largest unit it reaches, to a tenth (``"4.0 MiB"``, ``"1,000 B"``);
    integer arithmetic only, so no int is too large for it."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            tenths = (n * 10 + size // 2) // size  # rounded to a tenth of the unit
            return f"{tenths // 10:,}.{tenths % 10} {unit}"
    return f"{n:,} B"


def _bytes(n: int) -> str:
    """``n`` bytes exactly, and in units from 1 KiB (``"4,194,304 (4.0 MiB)"``)."""
    return f"{n:,}" if n < 1024 else f"{n:,} ({_size(n)})"


def _byte_cell(n: int) -> tuple[str, str]:
    """A cell of bytes: exact and in units where the table has room, else in units only."""
    return _bytes(n), _size(n)


def _age(low: float, high: float) -> str:
    """A record's age, ``low`` to ``high`` seconds (one figure when they differ by a tenth
    at most), in seconds, minutes from 10 min, hours from 100 min: ``"3.2 s"``,
    ``"21-23 min"``, ``"3.4 h"``."""
    unit, size = ("s", 1.0) if high < 600 else ("min", 60.0) if high < 6000 else ("h", 3600.0)

    def fig(x: float) -> str:
        x /= size
        return f"{x:.1f}" if x < 10 else f"{x:,.0f}"

    if high - low <= max(0.5, 0.1 * low) or fig(low) == fig(high):
        return f"{fig(low)} {unit}"
    return f"{fig(low)}-{fig(high)} {unit}"


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


#: Columns of free text (a stream's name, an origin, holders) are never made narrower than
#: this many characters (cut with "…" past what they are given); every other column is as
#: wide as its widest value: numbers are never cut nor wrapped.
MIN_TEXT = 12
#: Characters between two columns of a table: a space of padding each side of the separator.
_GAP = 3


class _Sheet:
    """One table: its text formatted from a reply (by ``render``, where a bad reply fails),
    laid out when drawn, for the terminal's width then (``layout``)."""

    def __init__(self, title: str, columns: list[tuple[str, str]], rows: list[list[Any]],
                 text: tuple[int, ...] = (), optional: tuple[int, ...] = ()) -> None:
        self.title = title
        self.columns = columns  # (header, justify)
        # a cell: a string (whatever a reply held there: drawing cannot fail on it), or
        # (wide, narrow): the narrow one where the wide ones do not fit
        self.rows = [[c if isinstance(c, tuple) else str(c) for c in row] for row in rows]
        self.text = text  # the columns of free text, which share what is left of the width
        self.optional = optional  # text columns left out, in this order, where the others do not fit

    def _fit(self, width: int) -> tuple[list[list[str]], list[int], list[int]] | None:
        """(the cells, the columns shown, their widths) for ``width`` columns: the wide form
        of every cell where all fit, else the narrow one, else the optional columns left
        out one by one; None when even then a number would be cut."""
        from rich.cells import cell_len

        for form, left_out in [(0, 0), *((1, k) for k in range(len(self.optional) + 1))]:
            cells = [[c if isinstance(c, str) else c[form] for c in row] for row in self.rows]
            shown = [i for i in range(len(self.columns)) if i not in self.optional[:left_out]]
            natural = {i: max([cell_len(self.columns[i][0])] + [cell_len(r[i]) for r in cells]) for i in shown}
            text = [i for i in shown if i in self.text]
            fixed = sum(w for i, w in natural.items() if i not in text) + _GAP * (len(shown) - 1)
            if fixed + sum(min(natural[i], MIN_TEXT) for i in text) <= width:
                break
        else:
            return None
        widths = dict(natural)
        room = width - fixed
        order = sorted(text, key=lambda i: natural[i])
        for k, i in enumerate(order):  # the narrowest first: what it leaves goes to the others
            widths[i] = min(natural[i], max(MIN_TEXT, room // (len(order) - k)))
            room -= widths[i]
        return cells, shown, [widths[i] for i in shown]

    def layout(self, width: int) -> tuple[Any, int]:
        """(the title and table, their width) for ``width`` terminal columns. Every column
        but the ``text`` ones is as wide as its widest value, in its wide form where they
        all fit, else the narrow one (bytes in units only); the ``text`` ones share what
        is left, at least ``MIN_TEXT`` each (or their widest value, if less); where that
        does not fit, the ``optional`` columns are left out, and where even that does not,
        a line says the table is too wide: a number is never cut."""
        from rich import box
        from rich.cells import cell_len
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        title = Text(self.title, style="bold")
        fit = self._fit(width)
        if fit is None:
            note = Text(f"(too wide for {width} columns)", style="dim")
            return Group(title, note), max(cell_len(note.plain), cell_len(self.title))
        cells, shown, widths = fit
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False)
        for i, w in zip(shown, widths):
            header, justify = self.columns[i]
            table.add_column(header, justify=justify, width=w, no_wrap=True, overflow="ellipsis")
        for row in cells:
            table.add_row(*(Text(row[i]) for i in shown))  # plain text: what a process sends is never read as markup
        return Group(title, table), max(sum(widths) + _GAP * (len(shown) - 1), cell_len(self.title))


def _beside(left: _Sheet, right: _Sheet, width: int) -> Any:
    """Two tables side by side where both fit in ``width``, else one above the other."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    (a, wa), (b, wb) = left.layout(width), right.layout(width)
    if wa + 2 + wb > width:
        return Group(a, Text(""), b)
    grid = Table.grid(padding=(0, 2))
    grid.add_row(a, b)
    return grid


def _filled(items: list[str], width: int) -> Any:
    """``items`` on as many lines as ``width`` needs, two spaces apart, none cut in two."""
    from rich.cells import cell_len
    from rich.text import Text

    lines = [""]
    for item in items:
        if lines[-1] and cell_len(lines[-1]) + 2 + cell_len(item) > width:
            lines.append(item)
        else:
            lines[-1] = f"{lines[-1]}  {item}" if lines[-1] else item
    return Text("\n".join(lines))


class _Screen:
    """What ``render`` returns: the text of one reply, laid out at each drawing for the
    console's width then (a terminal may be resized between two refreshes)."""

    def __init__(self, head: list[str], command: str, summary: list[str], pairs: list[tuple[_Sheet, _Sheet]],
                 largest: _Sheet, cost: str, sets: _Sheet | None = None) -> None:
        self.head, self.command, self.summary = head, command, summary
        self.pairs, self.largest, self.cost = pairs, largest, cost
        self.sets = sets  # the tensor sets table, where the process has loaded sets

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        width = options.max_width
        head = _filled(self.head, width)
        head.stylize("bold", 0, len(self.head[0]))
        yield head
        if self.command:
            yield Text(self.command, style="dim", no_wrap=True, overflow="ellipsis")
        yield _filled(self.summary, width)
        for left, right in self.pairs:
            yield Text("")
            yield _beside(left, right, width)
        if self.sets is not None:
            yield Text("")
            yield self.sets.layout(width)[0]
        yield Text("")
        yield self.largest.layout(width)[0]
        yield Text(self.cost, style="dim")


#: The most seconds (or milliseconds) a time of a reply may say (about 300 years).
MAX_TIME = 1e10
#: Characters of the process's path ("compiled", "pure-Python") shown in the head.
_PATH_CHARS = 20


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _count(value: Any, where: str) -> int:
    """``value``, a count, bytes or an id: an int from 0; ValueError naming ``where`` for
    anything else (a float, a bool, a negative number, a string)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{where} is {_shown(value)}, not an int from 0")
    return value


def _time(value: Any, where: str) -> float:
    """``value``, seconds or milliseconds: a number from 0 to ``MAX_TIME``; ValueError
    naming ``where`` else."""
    if type(value) not in (int, float) or not 0 <= value <= MAX_TIME:
        raise ValueError(f"{where} is {_shown(value)}, not a time from 0 to {MAX_TIME:g}")
    return float(value)


def _text(value: Any, where: str) -> str:
    """``value``, a name: a string, cut at ``MAX_TEXT`` characters; ValueError naming
    ``where`` else."""
    from ..inspection import MAX_TEXT

    if not isinstance(value, str):
        raise ValueError(f"{where} is {_shown(value)}, not a string")
    return value if len(value) <= MAX_TEXT else value[: MAX_TEXT - 1] + "…"


def render(reply: dict[str, Any], interval: float = 1.0, command: str = "") -> Any:
    """The screen for one reply of ``exchange.inspection`` (a rich renderable, laid out for
    the width of the console that draws it: at 80 columns and more every value is whole,
    numbers never cut; bytes are shown exactly and in units where a table has room, in
    units only where it has not; free text, the watched process's, shares what is left,
    cut with "…"; narrower, columns of text are left out, and a table that cannot fit
    says so, a number is never cut). Every string in ``reply``, and ``command``, is shown with its control
    characters escaped (``exchange.inspection.safe_text``), whoever made the reply. The
    reply is read here: what cannot be shown raises here (ValueError naming the field for
    a number that is not an int from 0 where a count, bytes, an id or a pid goes, nor a
    time from 0 to ``MAX_TIME`` where seconds go, or for a name that is not a string;
    TypeError, KeyError for a reply of another form), not when it is drawn."""
    from ..inspection import safe_reply, safe_text

    reply = safe_reply(reply)
    command = safe_text(command)
    s = reply["stats"]
    pid = _count(reply["pid"], "pid")
    path = _text(reply["path"], "path")
    path = path if len(path) <= _PATH_CHARS else path[: _PATH_CHARS - 1] + "…"
    head = ["tensor-exchange top", f"pid {pid}", f"up {_time(reply['uptime_s'], 'uptime_s'):.1f} s", f"{path} path",
            f"every {interval:g} s", "q quits"]
    live_bytes = {_text(d, "a device of stats.live_bytes"): _count(n, f"stats.live_bytes[{d!r}]")
                  for d, n in s["live_bytes"].items()}
    stat = {key: _count(s[key], f"stats.{key}") for key in (
        "live_records", "exports_outstanding", "imports_outstanding", "pending_releases", "created_total",
        "released_total", "remote_holders")}
    summary = [f"live records {stat['live_records']:,}", f"live bytes {sum(live_bytes.values()):,}",
               f"exports {stat['exports_outstanding']:,}", f"imports {stat['imports_outstanding']:,}",
               f"pending releases {stat['pending_releases']:,}", f"made {stat['created_total']:,}",
               f"released {stat['released_total']:,}"]

    scan = reply.get("scan")
    per_device = {}
    for d, n in (scan["records_by_device"] if scan else {}).items():
        per_device[_text(d, "a device of scan.records_by_device")] = _count(n, f"scan.records_by_device[{d!r}]")
    known = {}
    for k, d in enumerate(reply["devices"]):
        known[_text(d["device"], f"devices[{k}].device")] = (_count(d["live_bytes"], f"devices[{k}].live_bytes"),
                                                              _count(d["pending_bytes"], f"devices[{k}].pending_bytes"))
    rows = []
    for name in [*known, *(d for d in per_device if d not in known)]:
        live, pending = known.get(name, (0, 0))
        rows.append([name, _byte_cell(live), _byte_cell(pending),
                     f"{per_device[name]:,}" if name in per_device else "-"])
    devices = _Sheet("Memory by device", [("device", "left"), ("live bytes", "right"), ("pending bytes", "right"),
                                          ("records (scan)", "right")], rows or [["(none)", "0", "0", "-"]],
                     text=(0,))

    h = reply["holders"]
    tensors = "-" if h.get("tensors") is None else f"{_count(h['tensors'], 'holders.tensors'):,}"
    holders = _Sheet("Holders by kind", [("kind", "left"), ("holders", "right")], [
        ["tensors and views (scan)", tensors],
        ["DLPack exports", f"{_count(h['exports'], 'holders.exports'):,}"],
        ["other processes", f"{_count(h['remote_processes'], 'holders.remote_processes'):,}"],
        ["handles in transit", f"{_count(h['leases'], 'holders.leases'):,}"]])

    rows = [[_text(row["stream"], f"pending_streams[{k}].stream"), _text(row["device"], f"pending_streams[{k}].device"),
             f"{_count(row['releases'], f'pending_streams[{k}].releases'):,}"]
            for k, row in enumerate(reply["pending_streams"])]
    more = _count(reply.get("pending_streams_more", 0), "pending_streams_more")
    if more:
        rows.append([f"... {more:,} more streams", "", ""])
    streams = _Sheet(f"Pending releases by stream ({stat['pending_releases']:,})",
                     [("stream", "left"), ("device", "left"), ("releases", "right")], rows or [["(none)", "", "0"]],
                     text=(0, 1))

    rows = []
    for k, row in enumerate(reply["remote_processes"]):
        where = f"remote_processes[{k}]"
        rows.append([str(_count(row["pid"], f"{where}.pid")), f"{_count(row['records'], f'{where}.records'):,}",
                     _byte_cell(_count(row["bytes"], f"{where}.bytes")),
                     f"{_count(row['mappings'], f'{where}.mappings'):,}"])
    more = _count(reply.get("remote_processes_more", 0), "remote_processes_more")
    if more:
        rows.append([f"... {more:,} more", "", "", ""])
    remote = _Sheet(f"Remote holders by process ({stat['remote_holders']:,})",
                    [("pid", "right"), ("records", "right"), ("bytes", "right"), ("mappings", "right")],
                    rows or [["(none)", "", "", ""]])

    if scan:
        title = (f"Largest records (scan {_time(scan['age_s'], 'scan.age_s'):.1f} s old, "
                 f"{_count(scan['records'], 'scan.records'):,} records; "
                 f"one every {_time(scan['interval_s'], 'scan.interval_s'):g} s at most)")
    else:
        title = "Largest records (no scan yet)"
    rows = []
    for k, row in enumerate((scan or {}).get("largest", [])):
        where = f"scan.largest[{k}]"
        shown = [_text(x, f"{where}.holders") for x in row["holders"]]
        who = ", ".join(shown)
        count = _count(row["holders_count"], f"{where}.holders_count")
        if count > len(shown):
            who += f" (+{count - len(shown):,})"
        origin = _text(row["origin"], f"{where}.origin")  # says the kind too
        label = row.get("label")
        if label is not None and _text(label, f"{where}.label"):
            origin += f" [{_text(label, f'{where}.label')}]"
        rows.append([f"#{_count(row['id'], f'{where}.id')}", _text(row["device"], f"{where}.device"),
                     _byte_cell(_count(row["nbytes"], f"{where}.nbytes")), origin, who or "(none)",
                     _age(_time(row["age_s"], f"{where}.age_s"), _time(row["age_max_s"], f"{where}.age_max_s"))])
    largest = _Sheet(title, [("record", "right"), ("device", "left"), ("bytes", "right"), ("origin", "left"),
                             ("holders", "left"), ("age", "right")], rows, text=(1, 3, 4), optional=(4, 3))
    cost = (f"cost to the watched process: {_time(reply['reply_ms'], 'reply_ms'):.2f} ms for this reply"
            + (f", {_time(scan['took_ms'], 'scan.took_ms'):.1f} ms per scan" if scan else ""))
    return _Screen(head, command, summary, [(devices, holders), (streams, remote)], largest, cost,
                   _sets_sheet(reply.get("sets")))


def _sets_sheet(sets: Any) -> _Sheet | None:
    """The tensor sets table (name, role, newest version, its bytes, readers, live
    versions), or None where the reply has no ``sets`` (the process never loaded them)."""
    if sets is None:
        return None
    if not isinstance(sets, list):
        raise ValueError(f"sets is {_shown(sets)}, not a list")
    rows = []
    for k, row in enumerate(sets):
        where = f"sets[{k}]"
        rows.append([_text(row["name"], f"{where}.name"), _text(row["role"], f"{where}.role"),
                     f"{_count(row['version'], f'{where}.version'):,}",
                     _byte_cell(_count(row["nbytes"], f"{where}.nbytes")),
                     f"{_count(row['readers'], f'{where}.readers'):,}",
                     f"{_count(row['live_versions'], f'{where}.live_versions'):,}"])
    return _Sheet(f"Tensor sets ({len(rows):,})", [("set", "left"), ("role", "left"), ("version", "right"),
                                                   ("bytes", "right"), ("readers", "right"), ("live versions", "right")],
                  rows or [["(none)", "", "", "", "", ""]], text=(0, 1))


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

    console = Console()

    def follow_terminal() -> None:
        """The console's size, the terminal's now: rich keeps COLUMNS and LINES, where the
        environment has them, for good, and a resized terminal was drawn for its old size."""
        try:
            console.size = os.get_terminal_size(sys.stdout.fileno())
        except OSError:
            pass

    try:
        tty.setcbreak(fd)
        follow_terminal()
        with Live(draw(reply), console=console, screen=True, auto_refresh=False,
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
                follow_terminal()
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
