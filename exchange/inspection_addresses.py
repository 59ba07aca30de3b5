"""Finding a process's inspection socket from its pid, and telling who is at the other end.

Owns: the list of the names a process may serve on (``addresses``, from /proc/net/unix,
kept to the process's own sockets where /proc/<pid>/fd can be read), whether the
listener is that process now (``_listener_is``: ``SO_PEERPIDFD``), and what /proc says of
a process (its owner, state and start time). The client (exchange/inspection_client.py)
uses these before it trusts anything; none of it serves.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys

from .inspection_protocol import TOKEN_HEX

#: The largest pid a kernel can give (PID_MAX_LIMIT is 2**22; pid_t is 32 bits).
MAX_PID = 2**31 - 1
_PF_EXITING = 0x4  # /proc/<pid>/stat's flags (field 9): the process is on its way out


def addresses(pid: int) -> list[bytes]:
    """The inspection addresses process ``pid`` may serve on, for a client to try (the
    one whose ``SO_PEERCRED`` is ``pid`` is its own): the abstract socket names of the
    form :func:`address` gives for ``pid``, from this network namespace's list of Unix
    sockets (/proc/net/unix, readable by every user). Where /proc/<pid>/fd can be read
    (its user and root), only those that are the process's own sockets are kept: another
    user may bind names of that form (it cannot take the process's own, random one), even
    one whose ``SO_PEERCRED`` names ``pid``, made by a process that had that pid before.
    OSError when /proc/net/unix cannot be read."""
    with open("/proc/net/unix", "rb") as fh:
        listing = fh.read()
    # "Num: RefCount Protocol Flags Type St Inode Path", an abstract name's NUL shown as "@"
    line = rb"^\S+: \S+ \S+ \S+ \S+ \S+ +(\d+) @(tensor-exchange/inspect/%d/[0-9a-f]{%d})$" % (int(pid), TOKEN_HEX)
    found: dict[bytes, set[int]] = {}  # name -> its inodes listed (the listener's, its connections')
    for m in re.finditer(line, listing, re.MULTILINE):
        found.setdefault(b"\0" + m.group(2), set()).add(int(m.group(1)))
    if found:
        own = _socket_inodes(pid)
        if own is not None:
            return [name for name, inodes in found.items() if inodes & own]
    return list(found)


def _socket_inodes(pid: int) -> set[int] | None:
    """The inodes of process ``pid``'s sockets (/proc/<pid>/fd), or None when they cannot
    be read (another user's process, or one that is not dumpable)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


#: SO_PEERPIDFD (Linux 6.5): a pidfd of the process that made the listening socket. Python
#: names it from 3.13; its number elsewhere is that of the generic socket options, which
#: these machines use (others number their options otherwise: not asked there).
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", None)
if _SO_PEERPIDFD is None and sys.platform == "linux" and os.uname().machine in (
        "x86_64", "i686", "i386", "aarch64", "riscv64", "s390x", "ppc64le", "ppc64", "loongarch64"):
    _SO_PEERPIDFD = 77


def _listener_is(sock: socket.socket, pid: int) -> bool | None:
    """Whether the process that listens on the socket ``sock`` is connected to is process
    ``pid`` now. ``SO_PEERCRED`` gives the pid that process had when it listened: once it
    ended, a later process may be given that pid, and the socket, kept open by another
    process, then names the later one. A pidfd of the listener (``SO_PEERPIDFD``) says
    whether it still runs and its pid; None where the kernel cannot say (before 6.5)."""
    if _SO_PEERPIDFD is None:
        return None
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError as exc:
        return False if exc.errno in (errno.ESRCH, errno.EINVAL) else None  # 6.5 to 6.8: none for one that ended
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as fh:
            found = re.search(rb"^Pid:\s*(-?\d+)\s*$", fh.read(), re.MULTILINE)  # -1: it ended
    except OSError:
        return None
    finally:
        os.close(pidfd)
    return None if found is None else int(found.group(1)) == pid


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _owner(pid: int) -> int | None:
    """The uid owning process ``pid`` (/proc), or None when it cannot be read."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, flags, start time)`` of process ``pid`` from /proc/<pid>/stat (fields 3, 9
    and 22), or None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read()
        # The name (field 2) may hold spaces and parentheses: the fields after its last ")".
        fields = text.rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[6]), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None
