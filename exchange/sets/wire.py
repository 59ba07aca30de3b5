"""The wire of sets: messages between a publisher and its readers, and who is at the other end.

One ``SOCK_SEQPACKET`` Unix socket per reader (a message is one packet: no framing to get
wrong), JSON lists (never pickle), each checked for its kind, length and field types on
arrival (``check_request`` on the publisher's side, ``check_reply`` on the reader's); a
region's memory file travels with its version's reply (``SCM_RIGHTS``, one descriptor).

Reader -> publisher: ``["follow", rid, after]`` (the standing request, sent once: every
newest version above ``after`` as it is published, while the reader has fewer than two
offers outstanding, each counted as an *offer* until the reader says ``took``),
``["take", rid, after]`` (the newest version above ``after``, at once or at the next
publish, counted as the reader's hold at once), ``["took", number]`` (an offer of that
version became a hold), ``["unfollow", rid]`` (no more offers: the subscription closed),
``["decline", number]`` (an offer let go untaken), ``["release", number]`` (one hold of that
version let go); for device memory ``decline`` and ``release`` carry a third field, the
reader's release token (hex: the handle of its release event). Publisher -> reader:
``["version", rid, number, region, region_bytes, nbytes, layout, entries]`` with the
region's descriptor (``entries`` null when the reader's last version had the same
``layout`` id: the reader's checked copy serves), the hold (or offer) counted for this
reader in the same step; a version in device memory has a ninth field, its memory's part
(a list of ints and strings, which that memory's ``check_part`` checks whole: see the module
its memory channel names), and comes with at most one descriptor; ``["gone",
rid, why]`` (unpublished); ``["drop", region]`` (the publisher closed that region: a
reader holding nothing in it unmaps it, so that its memory goes); ``["counter", number]``,
first on each connection, with the descriptor of the sealed page where the publisher keeps
the newest version's number (a reader holding an offer reads there whether a newer one
exists). ``entries``: ``[key, dtype, shape, offset]`` per tensor, C-contiguous at
``offset`` bytes into the region.
"""

from __future__ import annotations

import array
import errno
import json
import socket
import struct
from typing import Any

from ..dtypes import dtype as as_dtype
from ..layout import check_shape
from ..runtime import close_fds

#: Longest message (bytes): a set of some thousands of tensors.
MAX_MESSAGE = 4 << 20
MAX_KEY = 256
#: Longest string in a memory's part or a release token (characters), and most fields of a part.
MAX_PART_STR = 256
MAX_PART_FIELDS = 8
_PEERCRED = struct.Struct("3i")


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end (``SO_PEERCRED``, the kernel's word)."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def send(sock: socket.socket, message: list, fd: int = -1, flags: int = 0) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if fd >= 0:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], flags)
    else:
        sock.send(data, flags)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it; (None, []) at end of stream.
    ValueError for a message that is not JSON or was cut short."""
    data, ancillary, msg_flags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(4 * 4),
                                                 getattr(socket, "MSG_CMSG_CLOEXEC", 0))
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % 4])
            fds.extend(got)
    if msg_flags & socket.MSG_CTRUNC:
        close_fds(fds)
        raise OSError(errno.EMFILE, "a descriptor sent with a message could not be received (is this process out "
                                    "of file descriptors? see ulimit -n)")
    if msg_flags & socket.MSG_TRUNC:
        close_fds(fds)
        raise ValueError("a message longer than the wire allows")
    if not data:
        close_fds(fds)
        return None, []
    try:
        return json.loads(data), fds
    except (ValueError, RecursionError):
        close_fds(fds)
        raise ValueError("a message that is not JSON") from None


def _int(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 63


def check_request(m: Any) -> list:
    """A reader's message, checked; ValueError otherwise (the publisher then drops it)."""
    if isinstance(m, list) and len(m) == 3 and m[0] in ("take", "follow") and _int(m[1]) and _int(m[2]):
        return m
    if isinstance(m, list) and len(m) == 2 and m[0] == "unfollow" and _int(m[1]):
        return m
    if isinstance(m, list) and len(m) == 2 and m[0] in ("release", "took", "decline") and _int(m[1]):
        return m
    if isinstance(m, list) and len(m) == 3 and m[0] in ("release", "decline") and _int(m[1]) and _hex(m[2]):
        return m
    raise ValueError("not a message of a set's reader")


def _hex(v: Any) -> bool:
    if type(v) is not str or not 0 < len(v) <= MAX_PART_STR or len(v) % 2:
        return False
    try:
        bytes.fromhex(v)
    except ValueError:
        return False
    return True


def _part(v: Any) -> bool:
    return isinstance(v, list) and 0 < len(v) <= MAX_PART_FIELDS and all(
        _int(x) or (type(x) is str and len(x) <= MAX_PART_STR) for x in v)


def check_reply(m: Any) -> list:
    """A publisher's message, checked field by field (its entries by ``check_entries``);
    ValueError otherwise."""
    if isinstance(m, list) and len(m) == 3 and m[0] == "gone" and _int(m[1]) and type(m[2]) is str:
        return m
    if isinstance(m, list) and len(m) == 2 and m[0] in ("drop", "counter") and _int(m[1]):
        return m
    if not (isinstance(m, list) and len(m) in (8, 9) and m[0] == "version" and all(_int(v) for v in m[1:7])
            and (m[7] is None or isinstance(m[7], list)) and (len(m) == 8 or _part(m[8]))):
        raise ValueError("not a message of a set's publisher")
    if m[5] > m[4]:
        raise ValueError("a version larger than its region")
    return m


def check_entries(entries: list, nbytes: int) -> list[tuple]:
    """A version's entries, checked (each C-contiguous inside the version's ``nbytes``,
    keys unique) and prepared: ``(key, offset, shape, strides, dtype)`` each. ValueError
    otherwise."""
    seen: set[str] = set()
    out = []
    for e in entries:
        if not (isinstance(e, list) and len(e) == 4 and type(e[0]) is str and 0 < len(e[0]) <= MAX_KEY
                and type(e[1]) is str and isinstance(e[2], list) and all(_int(n) for n in e[2]) and _int(e[3])):
            raise ValueError("a malformed entry")
        if e[0] in seen:
            raise ValueError("an entry named twice")
        seen.add(e[0])
        try:
            dt = as_dtype(e[1])
        except (TypeError, ValueError):
            raise ValueError(f"an entry of dtype {e[1][:32]!r}") from None
        shape = tuple(e[2])
        strides, _, extent = check_shape(shape, None, dt.itemsize, "a set entry")
        if e[3] % 64 or e[3] + extent > nbytes:
            raise ValueError("an entry outside its version's bytes")
        out.append((e[0], e[3], shape, strides, dt))
    return out
