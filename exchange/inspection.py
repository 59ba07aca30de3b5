"""Inspection: this process's registry, served on request to ``tensor-exchange top PID``
and ``tensor-exchange snapshot PID`` (docs/observability.md gives the reply's schema).

How it works:

* Nothing is served until asked: ``tx.serve_inspection()``, or ``EXCHANGE_INSPECT=1`` in
  the environment when ``exchange`` is imported. Then the process's one background thread
  (``tx-runtime``, exchange/runtime.py, which sharing uses too) watches an abstract Unix socket (``SOCK_SEQPACKET``, no file to leave behind) named
  from the pid and a random token, ``\\0tensor-exchange/inspect/<pid>/<32 hex digits>``
  (the sharing code's prefix), and sleeps in a selector: while nobody is connected it
  never wakes, and the library's hot paths do not know it exists. The token keeps another
  user from taking the name before the process serves (a name from the pid alone could be
  bound first: serving would then fail); a client finds the name from the pid
  (``addresses``: /proc/net/unix lists every abstract name) and checks who answers.
* Who may ask: the same check as sharing across processes (exchange/sharing/serving.py):
  the kernel's credentials of the connecting process (``SO_PEERCRED``), our own user or
  root; anyone else is disconnected unanswered. The client checks the other end too:
  the socket must belong to the pid it asked for (another user may bind names of the
  same form; they are passed over), whose process listens on it now (``_listener_is``:
  not one that had the pid before), of its own user or root; it tries names only until
  its timeout (another user may bind thousands).
* One request, one reply, JSON both ways (never pickle: any local process can connect to
  an abstract socket). A request is ``["inspect", SCHEMA, rows]``; the reply one JSON
  object. What a client sends is hostile until proven otherwise: a request over
  ``MAX_REQUEST`` bytes, one that is not JSON or not of that form, a client that does not
  read its replies, or one that sends no request for ``IDLE_S`` seconds, and the client is
  dropped; past ``MAX_CLIENTS`` at once a client is told so (``{"schema": 1, "refused":
  "too many clients are connected ..."}``) and dropped. The thread survives anything; the
  watched process never sees it.
* Strings in a reply (origins, labels, holders, streams) come from the watched process's
  users: every C0 and C1 control character, DEL, lone surrogate and invisible character
  that changes how text looks (bidirectional controls, zero-width characters) in them is
  written as a visible escape (``\\x1b``, ``\\u202e``) by the server (``safe_text``), and
  again by the client, which trusts no server: nothing a watched process sends reaches a
  terminal as an escape sequence.
* Cost to the watched process: the aggregates (``Registry.stats()``, the reaper's
  per-stream queue lengths, the counts the sharing server keeps per receiving process)
  are O(1) in the records alive and in those other processes hold; the largest-records
  table needs a scan of ``Registry.snapshot()``, done at most once every
  ``SCAN_INTERVAL_S`` seconds whoever asks, its result cached and its age given in
  every reply. The scan runs on the thread sharing uses too: sharing's messages wait
  for it (about 12 to 16 ms at 100,000 live records).
* Ages: the registry keeps no creation time per record (its hot path stays as it is), so
  the server notes ``(time, created_total)`` when it starts, at each request, and once a
  second while a client is connected; a record's age is bounded by the notes taken just
  before and after it was made (``age_s`` at least, ``age_max_s`` at most).
* A forked child does not serve (the thread is not inherited; the parent's sockets are
  closed in the child); it may call ``serve_inspection()`` itself.

Where it lives: this module is the public face and re-exports the names below from
exchange/inspection_protocol.py (schema, limits, address form, request parsing, safe
strings), exchange/inspection_server.py (the serving side),
exchange/inspection_addresses.py (finding a process's socket and who answers) and
exchange/inspection_client.py (``InspectionClient``, ``query``).
"""

from __future__ import annotations

# Every name below is re-exported: the tests and the command-line programs import them from here.
from .inspection_addresses import MAX_PID, addresses  # noqa: F401
from .inspection_client import InspectionClient, _Dropped, query  # noqa: F401
from .inspection_protocol import (  # noqa: F401
    IDLE_S, MAX_CLIENTS, MAX_HOLDERS, MAX_LIST, MAX_NOTES, MAX_NUMBER, MAX_REPLY, MAX_REQUEST, MAX_ROWS, MAX_TEXT,
    MAX_TIMEOUT_S, NOTE_INTERVAL_S, SCAN_INTERVAL_S, SCHEMA, TOKEN_HEX, InspectionError, address, parse_request,
    safe_reply, safe_text)
from .inspection_server import (  # noqa: F401
    _remote_processes, _server, inspection_address, serve_inspection, stop_inspection)

__all__ = ["serve_inspection", "stop_inspection", "inspection_address", "address", "addresses", "InspectionClient",
           "InspectionError", "query", "safe_text", "SCHEMA", "SCAN_INTERVAL_S", "MAX_ROWS", "IDLE_S",
           "MAX_TIMEOUT_S"]
