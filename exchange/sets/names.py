"""Where sets are found: the directory of names, only this user's to enter.

Owns the name rule (``check_name``), the directory (``directory()``: made 0700, opened
with ``O_NOFOLLOW`` and checked by ``fstat``: owned by this user, no access for anyone
else, not a symlink) and a name's two files there: ``<name>.sock``, the publisher's
listening socket, and ``<name>.lock``, the lock the publisher holds for its life
(``NameLock``). The kernel keeps other users out (they cannot enter the directory, so
they can neither list, connect to, bind nor lock a name), not a field in a message.
"""

from __future__ import annotations

import errno
import os
import re
import stat

from ..errors import ExchangeError

__all__ = ["check_name", "directory", "socket_path", "NameLock", "DIR_ENV"]

#: Overrides the directory (tests, containers): it is checked as the default one is.
DIR_ENV = "EXCHANGE_SETS_DIR"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_name(name: object) -> str:
    """``name`` if it is 1-64 characters of ``[A-Za-z0-9._-]`` and not ``.`` or ``..``;
    else ValueError (TypeError when it is not a str)."""
    if not isinstance(name, str):
        raise TypeError(f"a set's name is a str, got {type(name).__name__}")
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"a set's name is 1-64 characters of [A-Za-z0-9._-], not '.' or '..'; got {name!r}")
    return name


def _default_directory() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    if not os.path.isabs(base):
        base = "/tmp"
    return os.path.join(base, f"tensor-exchange-{os.getuid()}", "sets")


def _checked_dir(path: str) -> None:
    # Made 0700 if absent; then opened without following a symlink and checked on the
    # descriptor (not the path, which could be swapped between check and use).
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ExchangeError(f"the sets directory {path} is a symlink or not a directory: refused (another "
                                "user may have planted it); remove it, or set EXCHANGE_SETS_DIR") from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid() or not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077:
        raise ExchangeError(f"the sets directory {path} is owned by uid {st.st_uid} with mode "
                            f"{stat.S_IMODE(st.st_mode):o}; it must be this user's (uid {os.getuid()}) and 0700: "
                            "refused (another user could list, read or squat names there)")


def directory() -> str:
    """The checked directory of this user's sets (made on first use). ExchangeError when
    it, or its parent made by this library, is not this user's alone."""
    path = os.environ.get(DIR_ENV) or _default_directory()
    if not os.environ.get(DIR_ENV):
        _checked_dir(os.path.dirname(path))
    _checked_dir(path)
    return path


def socket_path(name: str) -> str:
    """The publisher's socket of set ``name`` (the name checked)."""
    return os.path.join(directory(), check_name(name) + ".sock")


def _holder_pid(fd: int) -> str:
    # The holder writes its pid right after taking the lock: a loser of a race may read
    # before that, so it reads again for a moment.
    import time

    deadline = time.monotonic() + 1.0
    while True:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        if text.isdigit() or time.monotonic() > deadline:
            return text if text.isdigit() else "unknown"
        time.sleep(0.005)


class NameLock:
    """The lock on a name (``flock`` on ``<name>.lock``), held by its publisher for its
    life: the kernel drops it when that process dies, so a dead publisher's name is
    taken over cleanly. The file holds the publisher's pid, for the error another
    process gets. ``close()`` lets the name go."""

    def __init__(self, name: str) -> None:
        import fcntl

        self.name = check_name(name)
        self.dir = directory()
        path = os.path.join(self.dir, name + ".lock")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ExchangeError(f"the set {name!r} is published by process {_holder_pid(self.fd)}, a live "
                                    "process of this user; only its publisher publishes it") from None
            os.pwrite(self.fd, str(os.getpid()).encode().ljust(20), 0)  # (one write, whole: no truncation first)
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def socket_path(self) -> str:
        return os.path.join(self.dir, self.name + ".sock")

    def close(self) -> None:
        """Unlink the socket file, then let the lock go (once)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        os.close(fd)

    def forget(self) -> None:
        """In a forked child: close this copy of the descriptor, touching nothing (the
        lock stays the parent's while it keeps its own copy)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
