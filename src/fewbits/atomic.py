"""Replacing a file atomically: the one way fewbits writes a file (fb.save, training checkpoints,
the study's report), so that an interrupted write never leaves something that looks finished, and
what a killed write left behind is recognisable by its name and removed by the next write of the
same target. Directories (a Hugging Face model directory) the same way: DirectoryReplacement
builds the new directory under a temporary name beside the target and renames it when complete.
A leaf module: it imports nothing of fewbits, so every layer may use it."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so stale temporary directories are not told from live ones
    fcntl = None

TEMP_MARK = ".fewbits-tmp-"
TEMP_RANDOM = re.compile(r"[a-z0-9_]{8}")  # what tempfile.mkdtemp puts after the prefix


class ConcurrentWriteError(BlockingIOError):
    """Another process (or another thread of this one) is writing the same target now: refused,
    so that two writers are never both told they succeeded while one silently replaces the other."""


# One writer per target. A writer (replacing(), DirectoryReplacement) holds an exclusive flock on
# a lock file of its target from its start to its end; a second writer of the same target, in
# any process of this user, finds it held and is refused with ConcurrentWriteError. The lock
# files live in a private directory of the user's (not beside the target, where a killed
# writer's would be left in the user's directory): named by the target's directory (device and
# inode, whatever path reaches it) and file name, removed by their holder at the end, and a lock
# file left by a killed writer (the kernel drops its lock) is taken by the next writer.
# Reentrant within a thread (a conversion that stages beside its output and then writes it);
# another thread of the same process is refused like another process. The directory is under
# tempfile.gettempdir(): writers that see different temporary directories (another TMPDIR, another
# container or machine sharing the target's file system) do not see each other's locks.
_held: dict[str, list] = {}  # lock file -> [fd, owning thread, depth]
_held_guard = threading.Lock()
# The temporary directories this process holds locked, as (device, inode): a locked one of a
# target's that is not among them belongs to a live writer elsewhere (see _remove_stale_temps),
# whatever lock directory that writer could or could not use.
_own_temps: set[tuple[int, int]] = set()


def _lock_directory() -> str | None:
    """The user's private directory of writer locks, made if missing; None where there can be
    none (no flock, or a directory that is not a private one of this user's)."""
    if fcntl is None:
        return None
    directory = os.path.join(tempfile.gettempdir(), f"fewbits-writers-{os.getuid()}")
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    try:
        st = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None  # not ours alone: no lock rather than a lock another user could hold or swap
    return directory


def _lock_file(path: str) -> str | None:
    directory = _lock_directory()
    if directory is None:
        return None
    try:
        parent = os.stat(os.path.dirname(path))
    except OSError:
        return None  # the write itself reports the missing directory
    key = f"{parent.st_dev}:{parent.st_ino}:{os.path.basename(path)}".encode("utf-8", "surrogateescape")
    return os.path.join(directory, hashlib.sha256(key).hexdigest()[:32] + ".lock")


def _take_writer_lock(path: str) -> str | None:
    """Take the one-writer lock of target `path` (absolute) for this thread: the lock file's name
    (give it to _drop_writer_lock at the end), or None where no lock can be had (the write goes
    on unguarded, as before there were locks). ConcurrentWriteError if another writer holds it."""
    name = _lock_file(path)
    if name is None:
        return None
    me = threading.get_ident()
    with _held_guard:
        entry = _held.get(name)
        if entry is not None:
            if entry[1] != me:
                raise ConcurrentWriteError(f"another thread of this process is writing {path}: "
                                           f"two writers of one file cannot both succeed; wait for it to finish")
            entry[2] += 1
            return name
        while True:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                             0o600)
            except OSError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConcurrentWriteError(f"another process is writing {path}: two writers of one file cannot "
                                           f"both succeed; wait for it to finish, or write another file") from None
            except OSError:  # a file system without locks
                os.close(fd)
                return None
            if _same_inode(fd, name):
                _held[name] = [fd, me, 1]
                return name
            os.close(fd)  # its holder removed it as we opened it: take the new one


def _drop_writer_lock(name: str | None) -> None:
    if name is None:
        return
    with _held_guard:
        entry = _held.get(name)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] > 0:
            return
        del _held[name]
        try:
            os.unlink(name)  # while still locked: nobody else can be holding this file
        except OSError:
            pass
        os.close(entry[0])  # drops the lock


def temp_prefix(path) -> str:
    """The name every temporary directory of replacing(path) starts with, beside the target:
    ".<target name>.fewbits-tmp-", then 8 random characters (nothing after them)."""
    return f".{os.path.basename(os.fspath(path))}{TEMP_MARK}"


@contextlib.contextmanager
def replacing(path) -> Iterator[str]:
    """`with replacing(path) as tmp:` write the new file at `tmp`; when the block ends without an
    error, `tmp` is synced, given a normal file's mode and renamed over `path`, and the rename is
    synced. `tmp` lies in a private temporary directory beside `path` (see temp_prefix), which is
    removed whether the block succeeds or fails (KeyboardInterrupt included).

    A directory, not a file, because a writer may itself write through a temporary file of its
    own (safetensors writes ".tmpXXXXXX" beside the name it is given, then renames it): inside our
    directory that one is ours to clean up too. A process killed outright (SIGKILL, power loss)
    cannot remove it, so each write first removes what earlier writes of the same target left that
    nobody is writing any more: a writer holds an exclusive flock on its directory from creation
    to the end, which the kernel drops when the process dies, so an unlocked directory of ours
    with our name is stale.

    One writer per target: while one replacing() or DirectoryReplacement of `path` runs, another
    one of the same path, in this process or another, is refused at its start with
    ConcurrentWriteError (see _take_writer_lock); the same thread may nest them."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = temp_prefix(path)
    writer = _take_writer_lock(os.path.abspath(path))
    try:
        _remove_stale_temps(directory, prefix)
        fd, tmpdir = _locked_temp_dir(directory, prefix)
        tmp = os.path.join(tmpdir, os.path.basename(path))
        try:
            try:
                yield tmp
                sync_fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(sync_fd)
                finally:
                    os.close(sync_fd)
                os.chmod(tmp, 0o666 & ~_umask())  # private so far; give it a normal file's mode
                os.replace(tmp, path)
            finally:
                _remove_temp_dir(tmpdir)
        finally:
            if fd is not None:
                _unlock_temp(fd)
        _fsync_directory(directory)
    finally:
        _drop_writer_lock(writer)


def _locked_temp_dir(directory: str, prefix: str) -> tuple[int | None, str]:
    """(fd holding an exclusive flock on it, or None without flock; path) of a new empty
    private directory. The lock is taken right after creation; should a cleaner in another
    process have taken the directory for stale in between (it removes it before letting go),
    another name is tried."""
    while True:
        tmpdir = tempfile.mkdtemp(dir=directory, prefix=prefix)
        if fcntl is None:  # no locks (and a directory may not open as a file there)
            return None, tmpdir
        try:
            fd = os.open(tmpdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except BaseException:
            _remove_temp_dir(tmpdir)
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: cleaners cannot lock it either, so skip it
                return fd, tmpdir
            if _same_inode(fd, tmpdir):
                st = os.fstat(fd)
                with _held_guard:
                    _own_temps.add((st.st_dev, st.st_ino))
                return fd, tmpdir
        except BaseException:
            os.close(fd)
            _remove_temp_dir(tmpdir)
            raise
        os.close(fd)


def _unlock_temp(fd: int) -> None:
    """Close the fd of a temporary directory from _locked_temp_dir (dropping its lock)."""
    try:
        st = os.fstat(fd)
        with _held_guard:
            _own_temps.discard((st.st_dev, st.st_ino))
    finally:
        os.close(fd)


def _same_inode(fd: int, path: str) -> bool:
    """Whether `path` still names the file or directory open as `fd`."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


class DirectoryReplacement:
    """A new directory at `path`, built in a private temporary directory beside it (named as
    replacing() names its own, see temp_prefix, and locked the same way while it is written) and
    renamed to `path` by commit() once complete; abort() (or an exception inside `with`) removes
    it. Nothing at `path` looks finished before commit(): the target appears in one rename.

    An existing `path` is refused (FileExistsError) unless overwrite=True; then commit() moves the
    old one into a temporary directory of ours, renames the new one in and removes the old (a
    process killed between those two renames leaves no target, and the old one under a temporary
    name, which the next write removes). Each write first removes the temporary directories of
    earlier writes of the same target that nobody holds any more.

    One writer per target, as for replacing(): from construction to commit() or abort() it holds
    the target's writer lock, so a second writer of `path` (another process, another thread) is
    refused at its construction with ConcurrentWriteError; the same thread may nest writers."""

    def __init__(self, path, overwrite: bool = False):
        self.path = os.path.abspath(os.fspath(path))
        self.overwrite = overwrite
        if os.path.lexists(self.path) and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass overwrite=True to replace it")
        self._parent = os.path.dirname(self.path)
        self._prefix = temp_prefix(self.path)
        self._fd = self._writer = None
        os.makedirs(self._parent, exist_ok=True)
        self._writer = _take_writer_lock(self.path)
        try:
            _remove_stale_temps(self._parent, self._prefix, tree=True)
            self._fd, self.tmp = _locked_temp_dir(self._parent, self._prefix)
            os.chmod(self.tmp, 0o777 & ~_umask())  # a model directory, readable as any other
        except BaseException:
            self._release()
            raise
        self.done = False

    def __enter__(self) -> DirectoryReplacement:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self.done:
            self.abort()
        return False

    def commit(self) -> None:
        """Sync every file written, then rename the directory to the target."""
        if self.done:
            raise RuntimeError("this directory was already committed or aborted")
        for name in os.listdir(self.tmp):
            full = os.path.join(self.tmp, name)
            if os.path.isfile(full) and not os.path.islink(full):
                fd = os.open(full, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_directory(self.tmp)
        old_fd = old_dir = None
        try:
            if os.path.lexists(self.path):
                if not self.overwrite:
                    raise FileExistsError(f"{self.path} appeared while it was written; pass overwrite=True to replace it")
                old_fd, old_dir = _locked_temp_dir(self._parent, self._prefix)
                os.rename(self.path, os.path.join(old_dir, "old"))
            os.rename(self.tmp, self.path)
            self.done = True
        finally:
            if old_dir is not None:
                _remove_temp_dir(old_dir, tree=True)
                if old_fd is not None:
                    _unlock_temp(old_fd)
            if self.done:
                self._release()
        _fsync_directory(self._parent)

    def abort(self) -> None:
        """Remove the temporary directory and what was written in it."""
        if self.done:
            return
        self.done = True
        _remove_temp_dir(self.tmp, tree=True)
        self._release()

    def _release(self) -> None:
        if self._fd is not None:
            _unlock_temp(self._fd)
            self._fd = None
        writer, self._writer = self._writer, None
        _drop_writer_lock(writer)


def _remove_temp_dir(tmpdir: str, tree: bool = False) -> None:
    """Remove a temporary directory of replacing() and the files in it (best effort: the error that
    got us here matters more). Only its own entries: files and links, never a subdirectory; with
    `tree` (DirectoryReplacement's directories) subdirectories too, links never followed."""
    if tree:
        shutil.rmtree(tmpdir, ignore_errors=True)
        return
    try:
        names = os.listdir(tmpdir)
    except OSError:
        return
    for name in names:
        full = os.path.join(tmpdir, name)
        try:
            if not stat.S_ISDIR(os.lstat(full).st_mode):
                os.remove(full)
        except OSError:
            pass
    try:
        os.rmdir(tmpdir)
    except OSError:
        pass


def _remove_stale_temps(directory: str, prefix: str, tree: bool = False) -> None:
    """Remove the temporary directories named `prefix` + 8 random characters in `directory`
    that are owned by this user and locked by no writer (see replacing). Without flock (not
    POSIX) a live writer cannot be told from a dead one, and nothing is removed.

    One locked by a writer outside this process means that writer is writing the same target now:
    ConcurrentWriteError. This catches the second writer where the lock files cannot (a writer
    with another temporary directory, another container; a lock directory another user made)."""
    if fcntl is None:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and TEMP_RANDOM.fullmatch(name[len(prefix):])):
            continue
        full = os.path.join(directory, name)
        try:
            seen = os.lstat(full)
            if not stat.S_ISDIR(seen.st_mode) or seen.st_uid != os.getuid():
                continue  # only directories of ours are opened at all
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a save in progress: ours (a staged conversion), or another writer's
                st = os.fstat(fd)
                with _held_guard:
                    ours = (st.st_dev, st.st_ino) in _own_temps
                if ours:
                    continue
                target = os.path.join(directory, prefix[1:-len(TEMP_MARK)])
                raise ConcurrentWriteError(f"another process is writing {target}: two writers of one file cannot "
                                           f"both succeed; wait for it to finish, or write another file") from None
            except OSError:
                continue  # a file system without locks
            if _same_inode(fd, full):
                _remove_temp_dir(full, tree=tree)
        finally:
            os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _fsync_directory(directory: str) -> None:
    """Make the rename durable; not every platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
