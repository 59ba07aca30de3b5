"""The wire of sharing across processes: what a handle carries and how it is checked,
the messages on the socket, and the small system helpers both sides use.

Owns: ``PROTOCOL``, the waits (``settings``), ``HandleFields`` (a handle's contents)
and ``check_fields`` (the memory channel's own part is checked by that channel:
``channel_of``), who a process is (``identity``: pid, start time, boot; what a handle
says of its sender and what a receiver checks of the process at the other end), the
messages' encoding (JSON, never pickle: any local process can connect to an abstract
socket), descriptor helpers and the out-of-descriptors error.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import struct
from typing import Any, NamedTuple

from ..device import Device
from ..dtypes import dtype as as_dtype
from ..layout import check_shape
from ..runtime import close_fds  # noqa: F401  (used here; importers take it from here)

#: Version of the handle and of the messages on the socket (4: fences, and the
#: watermark in a CPU attach's answer; 5: the handle's device part is the channel's).
PROTOCOL = 5
#: Seconds the serving thread waits before accepting again when it had no descriptor free.
ACCEPT_RETRY_S = 0.1
MAX_MESSAGE = 1 << 16
#: Most messages in one batch packet a receiver sends (releases, takes); the rest are ignored.
MAX_BATCH = 1024
#: A sender's address: an abstract Unix socket name (leading NUL) of this library's
#: form, at most what ``sockaddr_un.sun_path`` holds (108 bytes).
ADDRESS_PREFIX = b"\0tensor-exchange/"
MAX_ADDRESS = 107
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)  # received descriptors are not inherited by exec
FD_ERRNOS = (errno.EMFILE, errno.ENFILE)

_BOOT_ID: str | None = None


class Settings:
    """The waits of sharing across processes, in seconds: ``exchange.sharing.settings``.

    ``request_timeout`` (30.0): the longest ``tx.attach`` waits for a sender, connection
    and answer together (a handle's ``close()`` too, when it must connect first). A
    sender that is stopped or stuck, or whose backlog is full, fails the attach with
    ExchangeError after it, and never delays attaches of other senders.
    ``reply_timeout`` (5.0): the longest this process's serving thread waits to hand an
    answer to a receiver that does not read it; that receiver is then disconnected
    (its holds are dropped, as when it dies).

    Read at each use: a change applies to the next wait, on connections already open
    too. Setting a name it does not have raises AttributeError; a value that is not a
    number of seconds > 0, TypeError or ValueError.
    """

    __slots__ = ("_request_timeout", "_reply_timeout")

    def __init__(self) -> None:
        self._request_timeout = 30.0
        self._reply_timeout = 5.0

    @staticmethod
    def _seconds(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"exchange.sharing.settings.{name} is a number of seconds, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"exchange.sharing.settings.{name} must be a finite number of seconds > 0, got {value!r}")
        return float(value)

    @property
    def request_timeout(self) -> float:
        return self._request_timeout

    @request_timeout.setter
    def request_timeout(self, value: float) -> None:
        self._request_timeout = self._seconds("request_timeout", value)

    @property
    def reply_timeout(self) -> float:
        return self._reply_timeout

    @reply_timeout.setter
    def reply_timeout(self, value: float) -> None:
        self._reply_timeout = self._seconds("reply_timeout", value)

    def __repr__(self) -> str:
        return f"exchange.sharing.settings(request_timeout={self._request_timeout:g}, reply_timeout={self._reply_timeout:g})"


#: The one configuration object of sharing (also ``exchange.sharing.settings``).
settings = Settings()


def boot_id() -> str:
    """This machine's boot id (/proc/sys/kernel/random/boot_id; "" off Linux)."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
                _BOOT_ID = fh.read().strip()
        except FileNotFoundError:  # not Linux: no boot id, sharing cannot work there anyway
            _BOOT_ID = ""
        # Any other OSError (no file descriptor left, say) goes to the caller and is not
        # remembered: the next call reads the boot id again.
    return _BOOT_ID


_START: tuple[int, int] | None = None  # (pid, start time) of this process, once read


def own_start() -> int:
    """This process's start time (clock ticks after boot, /proc/self/stat field 22): with
    its pid and the boot id it names this process and no other, ever (a pid is reused,
    a start time with it is not). Read again in a forked child."""
    global _START
    pid = os.getpid()
    if _START is None or _START[0] != pid:
        _START = (pid, _stat_start("/proc/self/stat"))
    return _START[1]


def _stat_start(path: str) -> int:
    with open(path, "rb") as fh:
        text = fh.read()
    # The name (field 2) may hold spaces and parentheses: the fields after its last ")".
    return int(text.rsplit(b")", 1)[1].split()[19])


def identity(pid: int) -> tuple[int, list[int]]:
    """``(start time, pids)`` of the process this process sees as ``pid``: the pids are
    its NSpid line, from this PID namespace's number down to its own (its last is the
    pid it sees itself as, what its handles carry). ProcessLookupError when it has
    gone; PermissionError when /proc hides it (hidepid)."""
    try:
        start = _stat_start(f"/proc/{pid}/stat")
        with open(f"/proc/{pid}/status", "rb") as fh:
            lines = [line for line in fh if line.startswith(b"NSpid:")]
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    pids = [int(x) for x in lines[0].split()[1:]] if lines else [pid]  # no NSpid before Linux 4.1
    return start, pids


SO_PEERPIDFD = 77  # Linux 6.5: a pidfd of the peer, taken when it connected or listened (not in Python's socket yet)


def out_of_fds(what: str, exc: OSError | None = None) -> OSError:
    """The OSError for ``what`` failing because this process has no file descriptor left."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = exc.errno if exc is not None and exc.errno in FD_ERRNOS else errno.EMFILE
    error = OSError(code, f"{what} needs a free file descriptor and this process has none left "
                         f"({os.strerror(code)}; RLIMIT_NOFILE {soft}/{hard}): close some files or raise the "
                         "limit, then try again (nothing was mapped or kept)")
    error.tx_out_of_fds = True  # said once: attach does not wrap it again
    return error


def encode(message: list) -> bytes:
    return json.dumps(message).encode()


def decode(data: bytes) -> Any:
    """A message's value; ValueError for bytes that are not one (nested past the
    interpreter's recursion limit included: ``b"[" * 60000`` raises RecursionError in
    ``json.loads``)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("a message nested too deep") from None


# -- the handle's contents -----------------------------------------------------------------------
class HandleFields(NamedTuple):
    """What a ``tx.ShareHandle`` carries (its pickle is this tuple), in this order."""

    version: int
    boot: str          # /proc/sys/kernel/random/boot_id of the sender's machine and boot
    pid: int           # the sender's pid, as it sees itself
    start: int         # the sender's start time (own_start): pid, start and boot name one process
    address: bytes     # the sender's socket name (abstract namespace)
    entry: int         # which shared memory of the sender
    secret: bytes      # random per shared memory; the sender checks it
    nonce: int         # this handle's lease
    kind: str          # the memory channel's kind (exchange/channels/), or "empty" (no bytes: nothing to map)
    device: str        # the sender's device, as Device.parse reads it
    dtype: str
    shape: tuple
    strides: tuple     # in elements
    offset: int        # bytes from the start of the memory to element 0
    span: int          # bytes of the shared memory
    readonly: bool
    channel: tuple     # the memory channel's own part (its check_part checks it)
    arena: int         # the sender's arena holding the memory (0: memory of its own, tx.share(isolated=True))
    base: int          # bytes from the start of the arena to the memory
    once: bool         # attached once (multiprocessing's reducer): a receiver that maps the arena takes it
                       # locally, unless its nonce is at or below the sender's watermark (drop_leases)


def check_fields(fields: Any) -> HandleFields:
    """``fields`` as HandleFields, checked for form (the sender checks the secret).
    ValueError for a truncated, corrupted or forged handle."""
    def bad(why: str) -> ValueError:
        return ValueError(f"not a valid tx.ShareHandle ({why}): truncated, corrupted or forged; "
                          "make a new one with tx.share(tensor) in the sending process")

    if not isinstance(fields, tuple) or len(fields) != len(HandleFields._fields):
        raise bad(f"{len(fields) if isinstance(fields, tuple) else type(fields).__name__} fields, "
                  f"expected {len(HandleFields._fields)}")
    f = HandleFields(*fields)
    if f.version != PROTOCOL:
        raise bad(f"protocol version {f.version!r}, this library speaks {PROTOCOL}")
    if tuple(map(type, f)) != _TYPES:  # exact types: what this library's pickles carry (no bool for an int)
        name, value = next((n, v) for n, v, k in zip(HandleFields._fields, f, _TYPES) if type(v) is not k)
        raise bad(f"field {name} is {type(value).__name__}")
    if not f.kind or len(f.secret) != 16 or f.pid <= 0 or f.start < 0:
        raise bad("kind, secret, pid or start time")
    if f.kind != "empty" and not (f.address.startswith(ADDRESS_PREFIX) and len(f.address) <= MAX_ADDRESS):
        raise bad("the sender's address")
    if len(f.strides) != len(f.shape) or not all(type(n) is int for n in f.shape) \
            or not all(type(s) is int for s in f.strides):
        raise bad("shape or strides")
    if f.arena < 0 or f.base < 0 or (f.arena and f.base % 64):
        raise bad("arena or its offset")
    layout = (f.kind, f.device, f.dtype, f.shape, f.strides, f.offset, f.span)
    if layout not in _LAYOUTS_SEEN:  # (a stream of hand-offs repeats a few layouts: checked once each)
        _check_layout(f, bad)
        if len(_LAYOUTS_SEEN) >= 4096:
            _LAYOUTS_SEEN.clear()
        _LAYOUTS_SEEN[layout] = None
    if f.kind == "empty":
        if f.channel or f.arena:
            raise bad("an empty handle with memory")
        return f
    channel = channel_of(f)
    if channel is None:
        raise bad(f"no memory channel of kind {f.kind!r} carries {f.device} memory here")
    if not channel.check_part(f):
        raise bad(f"the {channel.label} part")
    return f


def channel_of(f: HandleFields) -> Any:
    """The memory channel of handle ``f`` (exchange/channels/), None when none here
    carries its memory under its kind. Loads the channel on first use."""
    found = _CHANNELS.get((f.kind, f.device))
    if found is None:
        from ..channels import channel_of_handle

        try:
            device_type = Device.parse(f.device).type
        except (TypeError, ValueError):
            return None
        found = channel_of_handle(f.kind, device_type)
        if found is not None:
            if len(_CHANNELS) >= 4096:
                _CHANNELS.clear()
            _CHANNELS[(f.kind, f.device)] = found
    return found


#: (kind, device) -> the channel of handles naming them (channel_of).
_CHANNELS: dict[tuple[str, str], Any] = {}


_TYPES = (int, str, int, int, bytes, int, bytes, int, str, str, str, tuple, tuple, int, int, bool, tuple, int, int, bool)
#: Layouts (kind, device, dtype, shape, strides, offset, span) that passed _check_layout.
_LAYOUTS_SEEN: dict[tuple, None] = {}


def _check_layout(f: HandleFields, bad: Any) -> None:
    try:
        dt = as_dtype(f.dtype)
        Device.parse(f.device)
    except (TypeError, ValueError) as exc:
        raise bad(str(exc)) from None
    try:  # the one layout check of capsules, tx.empty and tx.borrow (exchange/layout.py)
        _, lo, nbytes = check_shape(f.shape, f.strides, dt.itemsize, "the handle's layout")
    except ValueError as exc:
        raise bad(str(exc)) from None
    if f.kind == "empty" and nbytes != 0:
        raise bad("an empty handle with elements")
    if f.kind != "empty":
        if nbytes == 0:
            raise bad("no elements")
        if f.offset < 0 or f.span < 0 or f.offset + lo < 0 or f.offset + lo + nbytes > f.span:
            raise bad(f"the layout reaches outside the {f.span} shared bytes")
