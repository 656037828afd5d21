"""One writer per output folder: an advisory lock file held for a whole run.

A training workdir, a regenerated corpus folder and an evaluation output folder are each
written by one process at a time. `FolderLock` holds an exclusive `fcntl.flock` on
FOLDER/.lock for as long as the run lives and writes the holder's identity into it
(JSON: host, pid, start_time, what), so a second writer is refused with a message that
names the holder. The kernel drops a flock when its holder exits, crashes or is killed,
so a lock left behind by a dead run is never in the way: the next run takes it over
(and says so in one line). Without `fcntl` (or on a file system without flock) the
lock is an O_CREAT|O_EXCL file; a stale one (its pid gone on this host) is taken over.

Use as a context manager, or `acquire()` / `release()`; `release()` is idempotent.

An object-store folder (`gs://bucket/run`) has no file locks: the lock is skipped there
(`acquire()` logs one line and holds nothing), and one writer per such folder is the
user's responsibility (orbax's multi-process protocol still commits each checkpoint once).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
from typing import Any, Callable, Optional

from dblast_jax.io import paths

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["LOCK_FILE", "FolderLockedError", "FolderLock", "read_holder"]

LOCK_FILE = ".lock"


class FolderLockedError(FileExistsError):
    """Another live process writes to this folder (str(): one line naming it)."""


def read_holder(path: str) -> dict[str, Any]:
    """The holder record in a lock file ({} when absent or unreadable)."""
    try:
        with open(path) as f:
            data = json.loads(f.read() or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe(holder: dict[str, Any], what: bool = True) -> str:
    if not holder:
        return "an unknown process"
    run = f"{holder['what']} " if what and holder.get("what") else ""
    return (f"{run}pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {holder.get('start_time', '?')}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class FolderLock:
    """Exclusive lock on `folder` (FOLDER/.lock). `what` names the run in messages
    ("training", "regeneration", "evaluation"); `log` gets the one-line takeover note."""

    def __init__(self, folder: str, what: str = "run",
                 log: Optional[Callable[[str], None]] = None):
        self.remote = not paths.is_local(folder)  # gs://...: no lock (module doc)
        self.folder = paths.normalize(folder)
        self.path = paths.join(self.folder, LOCK_FILE)
        self.what = what
        self.log = log or (lambda s: None)
        self._fd: Optional[int] = None
        self._created_folder = False

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _refuse(self, holder: dict[str, Any]) -> FolderLockedError:
        mine = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
        fix = ("it is this very process: close the earlier one (e.g. Trainer.close()) first"
               if mine else "wait for it to finish or stop it, or use another folder; if no "
               f"such process is running, delete {self.path}")
        return FolderLockedError(
            f"{self.folder} is in use by another {holder.get('what') or self.what} "
            f"({_describe(holder, what=False)}; lock file {self.path}): {fix}")

    def acquire(self) -> "FolderLock":
        if self._fd is not None:
            return self
        if self.remote:
            self.log(f"{self.folder} is on an object store, which has no file locks: not "
                     f"locked; make sure no other {self.what} writes there")
            return self
        if not os.path.isdir(self.folder):
            os.makedirs(self.folder, exist_ok=True)
            self._created_folder = True
        me = {"host": socket.gethostname(), "pid": os.getpid(), "what": self.what,
              "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds")}
        try:
            if fcntl is not None:
                self._acquire_flock(me)
            else:  # pragma: no cover
                self._acquire_excl(me)
        except BaseException:
            self._cleanup_folder()
            raise
        return self

    def _acquire_flock(self, me: dict[str, Any]) -> None:
        for _ in range(20):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise self._refuse(read_holder(self.path)) from None
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    # a file system without flock (some network mounts): an O_EXCL file
                    if not read_holder(self.path):
                        try:
                            os.unlink(self.path)  # the empty file just created here
                        except OSError:
                            pass
                    return self._acquire_excl(me)
                raise
            # the file may have been unlinked (released) between open and flock: retry
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = read_holder(self.path)
            if previous:
                self.log(f"took over the stale lock of {self.folder} (left by "
                         f"{_describe(previous)}, no longer running)")
            try:
                self._write(fd, me)
            except OSError:
                pass  # e.g. a full disk: the flock holds; only the holder's name is missing
            self._fd = fd
            return
        raise FolderLockedError(f"could not lock {self.path}: it keeps changing; another "
                                f"process is racing for {self.folder}")

    def _acquire_excl(self, me: dict[str, Any]) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = read_holder(self.path)
                same_host = holder.get("host") == socket.gethostname()
                pid = holder.get("pid")
                if same_host and isinstance(pid, int) and not _pid_alive(pid):
                    self.log(f"took over the stale lock of {self.folder} (left by "
                             f"{_describe(holder)}, no longer running)")
                    os.unlink(self.path)
                    continue
                raise self._refuse(holder) from None
            try:
                self._write(fd, me)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
            self._fd = fd
            return
        raise self._refuse(read_holder(self.path))

    @staticmethod
    def _write(fd: int, me: dict[str, Any]) -> None:
        data = (json.dumps(me, sort_keys=True) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)  # while still holding it: no one else can have it now
        except OSError:
            pass
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # an O_EXCL lock (no flock here): the unlink above released it
        finally:
            os.close(fd)
        self._cleanup_folder()

    def _cleanup_folder(self) -> None:
        """A folder this lock created and nothing else wrote to is removed again."""
        if self._created_folder:
            self._created_folder = False
            try:
                os.rmdir(self.folder)
            except OSError:
                pass

    def keep_folder(self) -> None:
        """The run wrote its output: the folder stays after release."""
        self._created_folder = False

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):  # pragma: no cover - best effort
        try:
            if self._fd is not None:
                os.close(self._fd)
        except Exception:
            pass
