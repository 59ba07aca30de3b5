"""What both sides of inspection agree on, and the checks of what crosses between them.

Owns: the schema and the limits (``SCHEMA``, ``MAX_ROWS``, ``MAX_REQUEST``, ``MAX_REPLY``,
``IDLE_S`` ...), the address form (``address``), the parsing of a request
(``parse_request``) and the making safe of every string a reply carries (``safe_text``,
``safe_reply``: nothing a watched process sends reaches a terminal as an escape
sequence). The server (exchange/inspection_server.py) and the client
(exchange/inspection_client.py) both use it; exchange/inspection.py is the public face.
"""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import ExchangeError
from .sharing import protocol

#: Version of the request and of the reply's schema (docs/observability.md).
SCHEMA = 1
#: The largest-records scan runs at most once per this many seconds, whoever asks.
SCAN_INTERVAL_S = 5.0
#: Most rows of the largest-records table a reply carries.
MAX_ROWS = 50
#: Bytes: a longer request drops its client. A reply is at most MAX_REPLY bytes.
MAX_REQUEST = 256
MAX_REPLY = 1 << 20
#: Clients connected at once; more are told so and disconnected.
MAX_CLIENTS = 8
#: Seconds a connected client may go without sending a request before it is dropped (its
#: slot freed). ``top`` asks at every refresh (1 s by default) and reconnects on its own
#: when its ``--interval`` is longer than half of this.
IDLE_S = 5.0
#: The longest ``timeout`` a client accepts, in seconds.
MAX_TIMEOUT_S = 3600.0
#: Rows of the per-stream and per-process lists a reply carries (the rest counted).
MAX_LIST = 64
#: Holders described per record in the largest-records table (the rest counted).
MAX_HOLDERS = 8
#: Characters of a string the reply carries (a stream's repr, an origin, a label).
MAX_TEXT = 200
#: Seconds between the server's notes of (time, created_total) while a client is connected.
NOTE_INTERVAL_S = 1.0
#: Most notes kept (older ones thinned: coarser ages for old records).
MAX_NOTES = 4096


class InspectionError(ExchangeError):
    """An inspection request failed: the process is not serving, did not answer, or sent
    something that is not a reply of this library. The message says which and what to do."""


#: Hex digits of the random part of an inspection address (128 bits).
TOKEN_HEX = 32


def address(pid: int, token: str) -> bytes:
    """The abstract socket name process ``pid`` serves inspection on with ``token`` (its
    random part, ``TOKEN_HEX`` hex digits): ``\0tensor-exchange/inspect/<pid>/<token>``."""
    if not re.fullmatch(f"[0-9a-f]{{{TOKEN_HEX}}}", token):
        raise ValueError(f"an inspection token is {TOKEN_HEX} lowercase hex digits, got {token!r}")
    return protocol.ADDRESS_PREFIX + f"inspect/{int(pid)}/{token}".encode()


def _printable(name: bytes) -> str:
    return "@" + name[1:].decode()


#: What never reaches a terminal raw: C0 controls, DEL, C1 controls (ESC, CSI, OSC, BEL and
#: the rest), lone surrogates (which no terminal encoding can write), and the invisible
#: characters that change what text around them looks like: bidirectional controls
#: (U+061C, U+200E/F, U+202A-E, U+2066-9: "\u202e" shows what follows right to left, so
#: a label can pass for another), zero-width ones (U+200B-D, U+2060-4, U+FEFF, soft
#: hyphen U+00AD), line and paragraph separators (U+2028/9), interlinear annotations
#: (U+FFF9-B) and tags (U+E0000-7F, invisible text).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\xad\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069"
                      "\ufeff\ufff9-\ufffb\ud800-\udfff\U000e0000-\U000e007f]")


def _escape(match: re.Match) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"


def safe_text(value: Any) -> str:
    """``value`` as a string a terminal can show as it is: every C0 and C1 control
    character, DEL, lone surrogate, and invisible character that changes how the text
    around it looks (bidirectional controls, zero-width characters, line separators:
    ``_CONTROL``) written as a visible escape (``"\\x1b"``, four characters, for ESC;
    ``"\\u202e"`` for RIGHT-TO-LEFT OVERRIDE). What the watched process sends goes
    through this on both sides."""
    s = value if isinstance(value, str) else str(value)
    return _CONTROL.sub(_escape, s)


#: Numbers a reply may hold: an int is a count, bytes, a pid or an id (int64 at most),
#: a float is seconds or milliseconds (finite). Anything else is no reply of this library.
MAX_NUMBER = 2**63


def safe_reply(value: Any, depth: int = 0) -> Any:
    """``value`` (a decoded reply) with every string in it, keys included, made safe
    (``safe_text``); ValueError for a number no reply of this library has (an int of
    ``MAX_NUMBER`` or more, either sign; a float not finite) and past a nesting none has."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, int) and not -MAX_NUMBER < value < MAX_NUMBER:
        raise ValueError(f"an int out of range ({value.bit_length()} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a number out of range ({value})")
    if depth > 16:
        raise ValueError("nested too deep")
    if isinstance(value, dict):
        return {safe_text(k): safe_reply(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [safe_reply(v, depth + 1) for v in value]
    return value


def _text(value: Any) -> str:
    s = safe_text(value)
    return s if len(s) <= MAX_TEXT else s[: MAX_TEXT - 3] + "..."


def parse_request(data: bytes) -> int:
    """The rows a request asks for; ValueError (or TypeError) for anything else."""
    message = protocol.decode(data)
    if not isinstance(message, list) or len(message) != 3 or message[0] != "inspect":
        raise ValueError("not an inspection request")
    if message[1] != SCHEMA:
        raise ValueError(f"schema {message[1]!r}, this library speaks {SCHEMA}")
    rows = message[2]
    if type(rows) is not int or not 0 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in [0, {MAX_ROWS}]")
    return rows

