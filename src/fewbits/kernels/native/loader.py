"""The trusted loader of the C kernels: builds the sources of `csrc/` with the machine's C
compiler (`$CC`, else cc) for this CPU on first use, into a cache directory, and loads the
library with ctypes (`library()`), each binding module's argument types declared on it. Where
there is no compiler, the build fails or FEWBITS_NATIVE=0 is set, `library()` is None and every
caller keeps its torch path.

Cache: the library is built in and loaded from `cache_dir()`, the directory `native` under
$FEWBITS_CACHE, else $XDG_CACHE_HOME/fewbits, else ~/.cache/fewbits; the file name hashes the
source, the compiler's version, the flags and the CPU's feature flags, so a changed source or
another machine sharing the directory builds its own copy.

Trust. Loading a library runs its code (a constructor runs inside dlopen) as the user of
fewbits, so a library somebody else could write is a way into that user's account; and the
loader maps the file's segments, so a truncated library kills the process with SIGBUS when a
page past its end is touched. Hence:

- The directory is created 0700 (and so are the missing directories above it, whatever the
  umask) and used only if it is a directory (not a symbolic link) owned by the current user and
  not writable by group or others. It is checked on an open descriptor
  (fstat) and every later step goes through that descriptor (the *at calls; the compiler runs
  with it as its working directory, chdir'ed to /proc/self/fd/N), so swapping a path after the
  check changes nothing: nobody else can add, replace or rename files inside it.
- A build writes `.building-<host>-<pid>-<random>.so`, makes it 0700, fsyncs it, writes its
  SHA-256 beside it (the record, `<library>.sha256`) and renames both into place (library first),
  then fsyncs the directory: a reader never sees a partial file under the library's name.
- A library is loaded only if it is a regular file owned by the current user, not writable by
  group or others, and its bytes hash to the record. Check and load use one descriptor: the file
  is opened (O_NOFOLLOW), fstat'ed, read and hashed, and dlopen'ed as /proc/self/fd/N of that
  descriptor -- the same inode, whose bytes only its owner can change after the check (its mode
  was checked on that descriptor), and fewbits never writes into a published file: it renames new
  ones over it, which leaves a loaded library's inode as it was. The descriptor stays open while
  the library is loaded (for the process's life), so its /proc name is never reused for another
  file (the loader matches libraries by name); a name under which the loader already has a
  library that fewbits did not load (another component's, its descriptor since closed) is passed
  over for a higher descriptor number.
- Refused -- the directory fails its check, or the library, its record or `.lock` has another
  owner, is writable by group or others or is not a regular file (checked with lstat before it is
  opened, so a socket, FIFO or device is never opened): library() is None, so every caller keeps
  its torch path, with one RuntimeWarning per path naming the path and the reason. Nothing is
  deleted then: a file of another owner in one's own directory is for the user to look into.
- Corrupt -- no record, a malformed record, or bytes that do not hash to it (a truncated, empty
  or garbage file): rebuilt as above, and the bad file is never loaded.
- Loads and builds hold an exclusive flock on `.lock` in the directory (one build at a time; a
  load sees the library and its record in pairs). A `.building-*` file is removed by the next load
  once its builder is certainly gone: its process (named in the file name, with the host) is
  dead on this host, or the file is older than STALE_BUILD_S, longer than any build runs. A
  concurrent build's files -- another live process, or another host -- are left alone, and so
  are files of another owner.
- Where there is no /proc/self/fd or no fcntl (not Linux), nothing is loaded: the torch kernels
  serve (the module imports anywhere).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import re
import secrets
import shutil
import socket
import stat
import subprocess
import threading
import time
import warnings
from pathlib import Path

from .decode import declare_decode
from .int8mm import declare_int8mm
from .int8w import declare_int8w
from .introw import declare_introw
from .kquant import declare_kquant
from .lut4 import declare_lut4
from .round32 import declare_round32
from .rowquant import declare_rowquant
from .w4a8 import declare_w4a8

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no checked load there, the torch kernels serve
    fcntl = None

SOURCE_DIR = Path(__file__).parent.parent / "csrc"  # kernels/csrc: the sources and headers built
SOURCES = ("rowquant.c", "lut4.c", "round32.c", "kquant.c", "int8mm.c", "w4a8.c", "int8w.c", "decode.c", "introw.c")
HEADERS = ("vec16.h", "threads.h", "rowwalk.h", "tiles.h")
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c99")
# OpenMP where the compiler has it: the library then shares the process's OpenMP runtime with
# torch (torch loads its libgomp.so.1 first; the loader reuses a library already loaded under
# that name), so its threads are torch's threads, sized by torch.set_num_threads
OPENMP_FLAGS = ("-fopenmp",)
COMPILE_TIMEOUT_S = 120

LIBRARY_DIR = "native"  # the directory under the cache root the library lives in
DIGEST_SUFFIX = ".sha256"  # the record of a library's SHA-256, beside it
TEMP_PREFIX = ".building-"
# a build runs at most two compiles of COMPILE_TIMEOUT_S (with OpenMP, then without): a
# .building-* file older than this has no live builder, wherever that ran
STALE_BUILD_S = 3600
LOCK_WAIT_S = 2 * COMPILE_TIMEOUT_S + 60  # then build without the lock (publishing is atomic anyway)
MAX_LIBRARY_BYTES = 64 << 20  # the library is ~100 KB; anything this big is not ours
_TEMP_NAME = re.compile(r"\.building-([A-Za-z0-9._]+)-([0-9]+)-[0-9a-f]+\.(?:so|sha256)")
_FD_DIR = "/proc/self/fd"

_lock = threading.Lock()
_state: dict = {}  # "lib": the CDLL or None, "reason": why not, "path": the library file
_local = threading.local()
_held_fds: list[int] = []  # descriptors of the loaded libraries: open for the process's life
_handles: set[int] = set()  # the dlopen handles of the libraries loaded by _dlopen_fd
_warned: set[str] = set()  # paths a refusal was warned about (once per process)


class _Refused(Exception):
    """Something in the cache that is neither loaded nor replaced: it is not the current user's
    alone."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = str(path), reason


class _Corrupt(RuntimeError):
    """The cached library is not provably the one built: build it again."""


def _cache_root() -> Path:
    if os.environ.get("FEWBITS_CACHE"):
        return Path(os.environ["FEWBITS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fewbits"


def cache_dir() -> Path:
    """The directory the library is built in and loaded from: `native` under $FEWBITS_CACHE,
    else $XDG_CACHE_HOME/fewbits, else ~/.cache/fewbits (a directory of its own, so the cache
    root may be shared, e.g. for model files, while this one is the user's alone)."""
    return _cache_root() / LIBRARY_DIR


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    """The compiler's absolute path: it runs in the cache directory, where a relative one (CC=./cc,
    or a relative entry of PATH) would name another file or none."""
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc) or (shutil.which("gcc") if cc == "cc" else None)
    return os.path.abspath(found) if found else None


def _sources() -> list[Path]:
    return [SOURCE_DIR / s for s in SOURCES]


def _library_name(cc: str) -> str:
    """fewbits_native_<hash of sources, headers, compiler version, flags, CPU>.so"""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, errors="replace", timeout=30).stdout
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in _sources()), *((SOURCE_DIR / n).read_bytes() for n in HEADERS),
                 version.encode(), " ".join(CFLAGS + OPENMP_FLAGS).encode(), _cpu_flags().encode(),
                 platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return f"fewbits_native_{h.hexdigest()[:20]}.so"


def _check_owned(st: os.stat_result, path) -> None:
    """Raise _Refused unless st is the current user's and not writable by group or others."""
    if st.st_uid != os.geteuid():
        raise _Refused(path, f"is owned by uid {st.st_uid}, not by the current user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Refused(path, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")


def _make_dirs(path: Path) -> None:
    """Create `path` and its missing parents 0700 (the XDG base directory rule; a umask only
    takes bits away): under a umask of 000, Path.mkdir(parents=True) made them -- ~/.cache
    included -- writable by everybody. Directories that exist keep their mode (a cache root may
    be shared on purpose)."""
    if path.is_dir():
        return
    if path.parent != path:
        _make_dirs(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:  # made meanwhile by another process
        if not path.is_dir():
            raise


def _open_dir() -> tuple[int, Path]:
    """(descriptor, path) of cache_dir(), created 0700 where missing, and checked on that
    descriptor: a directory, not a symbolic link, of the current user, not writable by group
    or others (else _Refused)."""
    root, path = _cache_root(), cache_dir()
    _make_dirs(root)
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(LIBRARY_DIR, 0o700, dir_fd=rfd)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(LIBRARY_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _Refused(path, "is not a directory (a symbolic link or another file)") from None
            raise
    finally:
        os.close(rfd)
    try:
        st = os.fstat(fd)
        if created and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o700)  # what the umask took away, or left
            st = os.fstat(fd)
        _check_owned(st, path)
    except BaseException:
        os.close(fd)
        raise
    return fd, path


def _check_file(st: os.stat_result, path) -> None:
    """Raise _Refused unless st is a regular file of the current user, not writable by group or
    others."""
    if stat.S_ISLNK(st.st_mode):
        raise _Refused(path, "is a symbolic link")
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(path, "is not a regular file")
    _check_owned(st, path)


def _open_checked(dfd: int, name: str, path, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of the regular file `name` in the directory, owned by the current user and
    not writable by group or others (else _Refused); None where there is none. Checked with
    lstat before it is opened -- a socket cannot be opened, a device's open can act -- and again
    on the descriptor, which is what counts."""
    try:
        _check_file(os.stat(name, dir_fd=dfd, follow_symlinks=False), path)
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Refused(path, "is a symbolic link") from None
        raise
    try:
        _check_file(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_all(fd: int, limit: int, what: str = "it") -> bytes:
    """The file's bytes from offset 0 (_Corrupt past `limit`, saying `what` is larger)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
        if offset > limit:
            raise _Corrupt(f"{what} is larger than {limit} bytes")
    return b"".join(chunks)


def _open_verified(dfd: int, name: str, dir_path: Path) -> int | None:
    """A descriptor of the library `name` whose bytes, read through it, hash to its record;
    None where there is no library; _Corrupt where it is not provably the one built, _Refused
    where it or its record is not the current user's alone."""
    fd = _open_checked(dfd, name, dir_path / name)
    if fd is None:
        return None
    try:
        rfd = _open_checked(dfd, name + DIGEST_SUFFIX, dir_path / (name + DIGEST_SUFFIX))
        if rfd is None:
            raise _Corrupt("it has no SHA-256 record")
        try:
            record = _read_all(rfd, 100, "its SHA-256 record")
        finally:
            os.close(rfd)
        if not re.fullmatch(rb"[0-9a-f]{64}\n", record):
            raise _Corrupt("its SHA-256 record is malformed")
        data = _read_all(fd, MAX_LIBRARY_BYTES)
        if hashlib.sha256(data).hexdigest().encode() != record.strip():
            raise _Corrupt(f"its SHA-256 does not match the record of its build ({len(data)} bytes)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_lock(dfd: int, dir_path: Path) -> int:
    """A descriptor of `.lock` in the directory, created 0600 where missing; checked like the
    library (else _Refused): a lock file of another owner -- left from a time the directory was
    not private -- lets that owner hold every load for LOCK_WAIT_S, and one that is not a
    regular file is not ours either."""
    path = dir_path / ".lock"
    while True:
        fd = _open_checked(dfd, ".lock", path, os.O_RDWR)
        if fd is not None:
            return fd
        try:
            return os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                           dir_fd=dfd)
        except FileExistsError:  # created meanwhile by another process: check that one
            continue


@contextlib.contextmanager
def _dir_lock(dfd: int, dir_path: Path):
    """Hold the exclusive flock on `.lock` in the directory: one process at a time checks,
    builds and publishes. Where the file system has no flock, or another process held it past
    LOCK_WAIT_S, go on without: publishing is atomic and every load verifies anyway, so the
    lock only saves duplicate builds and spurious rebuilds."""
    fd = _open_lock(dfd, dir_path)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            except OSError:  # no flock here
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:64] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: past any pid, so no process
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _remove_stale_temps(dfd: int) -> None:
    """Remove the .building-* files of builds that are certainly over: their process is dead on
    this host, or they are older than STALE_BUILD_S. Others' (a concurrent build on this host or
    another) stay, and so do files of another owner: fewbits made none of them."""
    now, host = time.time(), _host()
    with os.scandir(dfd) as entries:
        names = [e.name for e in entries if e.name.startswith(TEMP_PREFIX)]
    for name in names:
        m = _TEMP_NAME.fullmatch(name)
        if m is None:
            continue  # not a name fewbits gives
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if st.st_uid != os.geteuid():
                continue
            dead = m.group(1) == host and not _pid_alive(int(m.group(2)))
            if dead or now - st.st_mtime > STALE_BUILD_S:
                os.unlink(name, dir_fd=dfd)
        except OSError:
            pass  # removed by another process meanwhile; a sweep is no reason not to load


def _write_new(dfd: int, name: str, data: bytes, mode: int) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _compile(cc: str, dfd: int, out_name: str) -> None:
    """Compile the sources into `out_name` in the directory of dfd: the compiler's working
    directory is that directory itself (chdir to /proc/self/fd/N in the child), not a path."""
    sources = [str(s) for s in _sources()]
    for extra in (OPENMP_FLAGS, ()):  # without OpenMP if the compiler has none
        r = subprocess.run([cc, *CFLAGS, *extra, "-o", out_name, *sources, "-lm"], cwd=f"{_FD_DIR}/{dfd}",
                           capture_output=True, text=True, errors="replace", timeout=COMPILE_TIMEOUT_S)
        if r.returncode != 1:
            # 0: built. Killed (< 0) or crashed (gcc's 4: a cc1 killed out of memory) is no sign
            # of a compiler without OpenMP: retried without it, the build would be cached for
            # good under the library's name without its threads
            break
    if r.returncode != 0:
        raise RuntimeError(f"{cc} failed (exit status {r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")


def _build(cc: str, dfd: int, name: str) -> int:
    """Build the library into the directory as `name` with its SHA-256 record, atomically;
    returns a descriptor of the new file: the bytes read through it are the ones recorded."""
    tmp = f"{TEMP_PREFIX}{_host()}-{os.getpid()}-{secrets.token_hex(8)}"
    tmp_lib, tmp_record = tmp + ".so", tmp + DIGEST_SUFFIX
    fd = -1
    try:
        _compile(cc, dfd, tmp_lib)
        fd = os.open(tmp_lib, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise RuntimeError(f"{cc} wrote {tmp_lib} as something other than a file of the current user")
        os.fchmod(fd, 0o700)  # the compiler's mode follows the umask
        os.fsync(fd)
        data = _read_all(fd, MAX_LIBRARY_BYTES)
        _write_new(dfd, tmp_record, (hashlib.sha256(data).hexdigest() + "\n").encode(), 0o600)
        os.replace(tmp_lib, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        os.replace(tmp_record, name + DIGEST_SUFFIX, src_dir_fd=dfd, dst_dir_fd=dfd)
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        for t in (tmp_lib, tmp_record):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(t, dir_fd=dfd)
    return fd


def _load(cc: str) -> tuple[ctypes.CDLL, Path, str]:
    """(the library, its path, a note) from the cache, built or rebuilt where needed."""
    if fcntl is None or not os.path.isdir(_FD_DIR):
        raise RuntimeError(f"loading a checked library needs {_FD_DIR} and fcntl (Linux)")
    name = _library_name(cc)
    dfd, dir_path = _open_dir()
    try:
        with _dir_lock(dfd, dir_path):
            _remove_stale_temps(dfd)
            note = ""
            try:
                fd = _open_verified(dfd, name, dir_path)
            except _Corrupt as e:
                fd, note = None, f"; rebuilt {dir_path / name}: {e}"
            if fd is None:
                fd = _build(cc, dfd, name)
    finally:
        os.close(dfd)
    lib = _dlopen_fd(fd)  # the very file whose bytes were hashed
    _declare(lib)
    return lib, dir_path / name, note


def _dlopen_fd(fd: int) -> ctypes.CDLL:
    """ctypes.CDLL of the file of `fd` as /proc/self/fd/N; takes over fd (held once loaded,
    closed otherwise). The loader looks a library up by name before it opens anything, so a
    library that another component loaded as /proc/self/fd/N, its descriptor since closed and N
    now ours, would come back in place of ours, unchecked. So a name under which the loader
    already has a library (RTLD_NOLOAD) that fewbits did not load is passed over: the descriptor
    moves to the next higher number (up to the descriptor limit, then OSError). One that fewbits
    loaded before can only be the same inode (fewbits' names stay held), just verified again."""
    try:
        while True:
            path = f"{_FD_DIR}/{fd}"
            try:
                found = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)._handle
            except OSError:  # nothing loaded under that name or from that inode
                found = None
            if found is None or found in _handles:
                break
            fd, old = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, fd + 1), fd
            os.close(old)
        lib = ctypes.CDLL(path)
    except BaseException:
        os.close(fd)
        raise
    _held_fds.append(fd)  # loaded: its /proc name must stay this file's
    _handles.add(lib._handle)
    return lib


def _warn_refused(e: _Refused) -> None:
    if e.path not in _warned:
        _warned.add(e.path)
        warnings.warn(f"fewbits: not loading the native library: {e.path} {e.reason}; using the torch kernels",
                      RuntimeWarning, stacklevel=3)


def _declare(lib: ctypes.CDLL) -> None:
    """The argument types of every function of the library, declared by each source's binding
    module."""
    for declare_source in (declare_rowquant, declare_lut4, declare_int8w, declare_round32, declare_kquant,
                           declare_int8mm, declare_w4a8, declare_decode, declare_introw):
        declare_source(lib)


def library() -> ctypes.CDLL | None:
    """The loaded native library, built on the first call; None when it cannot be had (see
    `status()` for why; inside `turned_off()`, None)."""
    if getattr(_local, "off", False):
        return None
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, reason, path = None, "", None
        if os.environ.get("FEWBITS_NATIVE", "1").lower() in ("0", "off", "false", "no"):
            reason = "turned off by FEWBITS_NATIVE=0"
        elif (cc := _compiler()) is None:
            reason = "no C compiler found (set CC)"
        else:
            try:
                lib, path, note = _load(cc)
                reason = f"built with {os.path.basename(cc)}{note}"
            except _Refused as e:
                _warn_refused(e)
                reason = f"refused: {e.path} {e.reason}"
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                lib, reason = None, f"build failed: {e}"
        _state.update(lib=lib, reason=reason, path=path)
        return lib


@contextlib.contextmanager
def turned_off():
    """Inside the block (in this thread) library() is None, so callers take their torch paths:
    for measuring what the C kernels gain, and for tests."""
    before = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = before


def status() -> dict:
    """{'available': bool, 'reason': str, 'path': str | None} (builds the library if needed)."""
    lib = library()
    if getattr(_local, "off", False):
        return {"available": False, "reason": "turned off in this thread by native.turned_off()", "path": None}
    return {"available": lib is not None, "reason": _state.get("reason", ""),
            "path": str(_state["path"]) if _state.get("path") else None}


def reset() -> None:
    """Forget the loaded library (the next call builds or loads it again); for tests."""
    with _lock:
        _state.clear()
