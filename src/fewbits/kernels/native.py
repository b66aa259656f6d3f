"""Small C kernels for hot loops that torch has no fused op for, built on first use.

torch runs one pass over memory per op, so a computation of six elementwise steps reads and
writes its data six times; torch.compile fuses them, but on this project's CPU its generated
code for a row reduction followed by a float -> int8 conversion took ~100 us for 64 x 4096
values against ~24 us for a plain C loop (the w8a8 activation quantizer), and a 16-entry table
lookup has no vector form in it at all (the 4-bit matmul). The C source lives in `csrc/`; the
first call compiles it
with the machine's C compiler (`$CC`, else cc) for this CPU into a cache directory and loads it
with ctypes. Where there is no compiler, the build fails or FEWBITS_NATIVE=0 is set,
`library()` is None and every caller keeps its torch path -- the reference the C kernels are
tested against: bit for bit, except the 4-bit matmul's float32 sums, whose order is its own.

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
import dataclasses
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
from collections.abc import Callable
from pathlib import Path

import torch

from . import hugepages

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no checked load there, the torch kernels serve
    fcntl = None

SOURCES = ("rowquant.c", "lut4.c", "round32.c", "kquant.c", "int8mm.c", "w4a8.c", "int8w.c", "decode.c")
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
    src_dir = Path(__file__).with_name("csrc")
    return [src_dir / s for s in SOURCES]


def _library_name(cc: str) -> str:
    """fewbits_native_<hash of sources, headers, compiler version, flags, CPU>.so"""
    src_dir = Path(__file__).with_name("csrc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, errors="replace", timeout=30).stdout
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in _sources()), *((src_dir / n).read_bytes() for n in HEADERS),
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


def declare_lut4(lib: ctypes.CDLL) -> None:
    """The argument types of lut4.c's functions (also for a build of lut4.c alone, as the tests
    make one per instruction set)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    params = ctypes.POINTER(_Lut4Params)
    lib.fb_lut4_matmul.argtypes = [p, i64, i64, p, params, p, i64, i64, i64, i64, p]
    lib.fb_lut4_matmul.restype = i32
    lib.fb_lut4_decode.argtypes = [p, params, p, i64, i64, i64, i64, p, i32]
    lib.fb_lut4_decode.restype = i32
    lib.fb_lut4_row.argtypes = [p, p, p]
    lib.fb_lut4_row.restype = i32
    lib.fb_tiles.argtypes = []
    lib.fb_tiles.restype = i32
    lib.fb_lut4_tile_matmul.argtypes = [p, i32, i64, i64, p, params, p, i64, i64, i64, i64, p]
    lib.fb_lut4_tile_matmul.restype = i32
    lib.fb_lut4_tiles.argtypes = [p, p, i64, p]
    lib.fb_lut4_tiles.restype = i32


def declare_int8w(lib: ctypes.CDLL) -> None:
    """The argument types of int8w.c's functions (also for a build of int8w.c alone)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_int8w_matmul.argtypes = [p, i64, i64, p, p, i64, i64, p]
    lib.fb_int8w_matmul.restype = i32
    lib.fb_int8w_row.argtypes = [p, p, p]
    lib.fb_int8w_row.restype = i32
    lib.fb_int8w_tile_matmul.argtypes = [p, i32, i64, i64, p, p, i64, i64, p]
    lib.fb_int8w_tile_matmul.restype = i32
    lib.fb_int8w_tiles.argtypes = [p, p, i64, p]
    lib.fb_int8w_tiles.restype = i32
    lib.fb_int8w_max_rows.argtypes = []
    lib.fb_int8w_max_rows.restype = i32


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_row_absmax.argtypes = [p, i64, i64, i64, p]
    lib.fb_row_absmax.restype = i64
    lib.fb_row_int8_scales.argtypes = [p, i64, i64, i64, p, p]
    lib.fb_row_int8_scales.restype = i64
    lib.fb_quantize_rows_int8.argtypes = [p, i64, i64, i64, p, i64, p, i32]
    lib.fb_quantize_rows_int8.restype = None
    lib.fb_scale_rows.argtypes = [p, i64, i64, i64, p, p]
    lib.fb_scale_rows.restype = None
    lib.fb_int8_rows_bf16.argtypes = [p, i64, i64, i64, p]
    lib.fb_int8_rows_bf16.restype = None
    declare_lut4(lib)
    declare_int8w(lib)
    u32 = ctypes.c_uint32
    lib.fb_round_float_f32.argtypes = [p, p, i64, p, i32, i32, u32, u32]
    lib.fb_round_float_f32.restype = i32
    lib.fb_round_lut_f32.argtypes = [p, p, i64, p, i32, p]
    lib.fb_round_lut_f32.restype = None
    lib.fb_round_lut_sr_f32.argtypes = [p, p, i64, p, i32, p, u32, u32]
    lib.fb_round_lut_sr_f32.restype = None
    lib.fb_round32_vectorized.argtypes = []
    lib.fb_round32_vectorized.restype = i32
    d = ctypes.c_double
    lib.fb_kquant_float_min.argtypes = [p, i64, i64, i32, p, d, p, i32, p, p]
    lib.fb_kquant_float_min.restype = None
    lib.fb_kquant_symmetric.argtypes = [p, i64, i64, i32, p, d, d, p, i32, p]
    lib.fb_kquant_symmetric.restype = None
    lib.fb_kquant_refine.argtypes = [p, i64, i64, i32, p, i32, d, d, p, p, p, p, p, p, p, p]
    lib.fb_kquant_refine.restype = None
    declare_int8mm(lib)
    declare_w4a8(lib)
    declare_decode(lib)


def declare_w4a8(lib: ctypes.CDLL) -> None:
    """The argument types of w4a8.c's functions (also for a build of it alone, as the tests make)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_w4a8_vectorized.argtypes = []
    lib.fb_w4a8_vectorized.restype = i32
    lib.fb_w4a8_matmul.argtypes = [p, p, i64, p, p, i32, p, i32, i32, i64, i64, p, i32]
    lib.fb_w4a8_matmul.restype = i32
    lib.fb_w4a8_linear.argtypes = [p, i64, i64, p, p, i32, p, i32, i32, i64, i64, p]
    lib.fb_w4a8_linear.restype = i32
    lib.fb_w4a8_row.argtypes = [p, p, p]
    lib.fb_w4a8_row.restype = i32
    lib.fb_w4a8_dequantized_x.argtypes = [p, i64, i64, i64, p, i32]
    lib.fb_w4a8_dequantized_x.restype = i32


def declare_int8mm(lib: ctypes.CDLL) -> None:
    """The argument types of int8mm.c's functions (also for a build of it alone, as the tests make)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.fb_amx_int8_ready.argtypes = []
    lib.fb_amx_int8_ready.restype = i32
    lib.fb_amx_packed_bytes.argtypes = [i64, i64]
    lib.fb_amx_packed_bytes.restype = i64
    lib.fb_amx_pack_b.argtypes = [p, i64, i64, i64, p]
    lib.fb_amx_pack_b.restype = None
    lib.fb_amx_gemm_s8.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i64, i64, p, i64, i32]
    lib.fb_amx_gemm_s8.restype = i32
    lib.fb_amx_pack_bt.argtypes = [p, i64, i64, i64, p]
    lib.fb_amx_pack_bt.restype = None
    lib.fb_amx_gemv_ready.argtypes = []
    lib.fb_amx_gemv_ready.restype = i32
    lib.fb_amx_gemv_u8.argtypes = [p, i64, p, i64, p, ctypes.c_float, p, p, p]
    lib.fb_amx_gemv_u8.restype = i32
    lib.fb_w8a8_amx_row.argtypes = [p, p, p]
    lib.fb_w8a8_amx_row.restype = i32
    lib.fb_vnni_ready.argtypes = []
    lib.fb_vnni_ready.restype = i32
    lib.fb_vnni_gemm_u8.argtypes = [p, i64, i64, i64, p, i64, p, p, p, p, p, i64]
    lib.fb_vnni_gemm_u8.restype = i32
    lib.fb_q8_rows_bf16.argtypes = [p, i64, i64, i64, p, i64, p, p]
    lib.fb_q8_rows_bf16.restype = None
    lib.fb_q8_cols_bf16.argtypes = [p, i64, i64, i64, p, i64, i32, p, p, p]
    lib.fb_q8_cols_bf16.restype = None


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


def _check_rows(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"native row kernels take a CPU float32 matrix with unit column stride, "
                         f"got {x.dtype} {x.device} shape {tuple(x.shape)} strides {x.stride()}")


def row_absmax(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(max |x| per row as float32 [rows], number of rows holding NaN or inf) for a float32
    matrix with unit column stride."""
    _check_rows(x)
    m, k = x.shape
    amax = torch.empty(m, dtype=torch.float32)
    bad = lib.fb_row_absmax(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, amax.data_ptr())
    return amax, int(bad)


def row_int8_scales(lib: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(scale = amax / 127, recip = 1 / scale with 0 read as 1, both float32 [rows], number of
    rows holding NaN or inf) for a float32 matrix with unit column stride."""
    _check_rows(x)
    m, k = x.shape
    scale, recip = torch.empty(m, dtype=torch.float32), torch.empty(m, dtype=torch.float32)
    bad = lib.fb_row_int8_scales(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, scale.data_ptr(),
                                 recip.data_ptr())
    return scale, recip, int(bad)


def quantize_rows_int8(lib: ctypes.CDLL, x: torch.Tensor, recip: torch.Tensor, offset: bool) -> torch.Tensor:
    """clamp(round_half_even(x * recip[row]), -128, 127) as int8 [rows, k], or as uint8 + 128
    with `offset`; recip is float32 with one value per row or a single value."""
    _check_rows(x)
    m, k = x.shape
    recip = recip.to(torch.float32).contiguous()
    if recip.numel() not in (1, m):
        raise ValueError(f"recip needs 1 or {m} values, got {recip.numel()}")
    q = torch.empty(m, k, dtype=torch.uint8 if offset else torch.int8)
    lib.fb_quantize_rows_int8(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, recip.data_ptr(),
                              1 if recip.numel() == m and m > 1 else 0, q.data_ptr(), 1 if offset else 0)
    return q


def scale_rows_(lib: ctypes.CDLL, y: torch.Tensor, row_scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[i, j] = fma(y[i, j], row_scales[i], bias[j]) in place (y * row_scales[i] without a
    bias); y float32 with unit column stride, row_scales and bias float32. Returns y."""
    _check_rows(y)
    m, n = y.shape
    row_scales = row_scales.reshape(-1).to(torch.float32).contiguous()
    if row_scales.numel() != m:
        raise ValueError(f"row_scales needs {m} values, got {row_scales.numel()}")
    if bias is not None:
        if bias.dtype != torch.float32 or bias.shape != (n,):
            raise ValueError(f"bias must be float32 of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
        bias = bias.contiguous()
    lib.fb_scale_rows(y.data_ptr(), m, n, y.stride(0) if m > 1 else n, row_scales.data_ptr(),
                      bias.data_ptr() if bias is not None else None)
    return y


def int8_rows_bf16(lib: ctypes.CDLL, q: torch.Tensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0..r1 of an int8 matrix q [N, K] as bfloat16 [r1 - r0, K], exactly (every int8 is a
    bfloat16). `out`: a contiguous bfloat16 buffer of at least that many values to write into
    (reused from block to block, it spares the page faults of fresh memory)."""
    if q.dtype != torch.int8 or q.dim() != 2 or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError(f"q must be a contiguous CPU int8 matrix, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows {r0}..{r1} out of 0..{n}")
    count = (r1 - r0) * k
    if out is None:
        out = torch.empty(r1 - r0, k, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() < count:
        raise ValueError(f"out must be a contiguous bfloat16 tensor of at least {count} values")
    else:
        out = out.reshape(-1)[:count].view(r1 - r0, k)
    lib.fb_int8_rows_bf16(q.data_ptr(), k, r0, r1, out.data_ptr())
    return out


def amx_int8_ready(lib: ctypes.CDLL) -> bool:
    """Whether int8mm.c's AMX GEMM runs here: the build has AMX and Linux granted the tile state."""
    return bool(lib.fb_amx_int8_ready())


_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int32: 2}

AMX_GEMV_MAX_K = 65536  # fb_amx_gemv_u8's sums stay exact in int32 up to this reduction length


def amx_pack(lib: ctypes.CDLL, qb: torch.Tensor) -> torch.Tensor:
    """qb [N, K] int8 (row-major, or the transpose of a row-major [K, N]) packed into int8mm.c's
    AMX panels (fb_amx_pack_b / fb_amx_pack_bt), the B operand of fb_amx_gemm_s8."""
    n, k = qb.shape
    packed = torch.empty(lib.fb_amx_packed_bytes(n, k), dtype=torch.int8)
    if qb.stride(0) == 1 and n > 1 and k > 1:  # the transpose of a row-major [K, N]: packed from it
        lib.fb_amx_pack_bt(qb.data_ptr(), k, n, qb.stride(1), packed.data_ptr())
    else:
        b = qb if qb.stride(1) == 1 else qb.contiguous()
        lib.fb_amx_pack_b(b.data_ptr(), n, k, b.stride(0) if n > 1 else k, packed.data_ptr())
    return packed


def _amx_gemm_panels(lib: ctypes.CDLL, qa: torch.Tensor, packed: torch.Tensor, n: int, da, db, bias,
                     out_dtype: torch.dtype) -> tuple[int, torch.Tensor]:
    """fb_amx_gemm_s8 of qa [M, K] int8 (padded here to M % 32 == 0, K % 64 == 0 with zeros) and
    amx_pack's panels of an [n, K] B; da / db / bias contiguous float32 or None: (rc, out [M, n])."""
    m, k = qa.shape
    mp, kp = -(-max(m, 1) // 32) * 32, -(-max(k, 1) // 64) * 64
    a = qa if (mp == m and kp == k and qa.stride(1) == 1) else \
        torch.nn.functional.pad(qa, (0, kp - k, 0, mp - m))
    out = torch.empty(m, n, dtype=out_dtype)
    ptr = lambda v: None if v is None else v.data_ptr()  # noqa: E731
    rc = lib.fb_amx_gemm_s8(a.data_ptr(), mp, kp, a.stride(0), packed.data_ptr(), n, ptr(da), ptr(db), ptr(bias),
                            m, n, out.data_ptr(), n, _OUT_KINDS[out_dtype])
    return rc, out


def amx_w8a8_ready(lib: ctypes.CDLL) -> bool:
    """Whether Int8Panels runs here with its batches on the tiles: int8mm.c's AMX GEMM and its VNNI
    one-row kernel."""
    return bool(lib.fb_amx_gemv_ready())


def vnni_w8a8_ready(lib: ctypes.CDLL) -> bool:
    """Whether Int8Panels runs here with VNNI dot products alone (tiles=False): AVX512-VNNI in the
    build, AMX or not."""
    return bool(lib.fb_vnni_ready())


def w8a8_amx_row_rc(rc: int) -> None:
    """Raise for a non-zero return code of fb_w8a8_amx_row."""
    if rc == -3:
        raise ValueError(NONFINITE_ACTIVATIONS)
    if rc:
        raise (MemoryError("the w8a8 row kernel could not allocate its buffer") if rc == -2
               else RuntimeError("the w8a8 row kernel cannot run here"))


class _W8A8Row(ctypes.Structure):
    """int8mm.c's W8A8Row: a w8a8 weight's fixed arguments for one row of x."""
    _fields_ = [("bp", ctypes.c_void_p), ("colsum128", ctypes.c_void_p), ("sw", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


def _streamed(t: torch.Tensor) -> torch.Tensor:
    """t, bytes a one-row kernel reads at every call (a prepared weight's codes or panels), after
    asking Linux to put it on transparent huge pages (kernels/hugepages.py: best effort, contents
    and address unchanged): the one place that decides which tensors go there."""
    hugepages.collapse(t)
    return t


class Int8Panels:
    """An int8 weight W [n, k] packed once into int8mm.c's AMX panels (fb_amx_pack_b), with 128 times
    its row sums, for w8a8 inference: y = (float32(q @ W.T) * sx[:, None]) * sw[None, :] (+ bias),
    the int32 sums exact -- one row with VNNI dot products over the panels (fb_amx_gemv_u8);
    batches of int8 activations on the tiles (tiles=True: fb_amx_gemm_s8, rows padded to 32) or,
    on CPUs without AMX (tiles=False), with the same VNNI dot products row by row
    (fb_vnni_gemm_u8); the same float32 steps everywhere, so a row gives the bits it gives inside a
    batch. The panels are the only copy of the codes: codes(panels, n, k) derives them."""

    def __init__(self, lib: ctypes.CDLL, q: torch.Tensor, tiles: bool = True):
        self.tiles = bool(tiles)
        if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu":
            raise ValueError(f"q must be a 2-D CPU int8 tensor, got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if not 0 < k <= AMX_GEMV_MAX_K:
            raise ValueError(f"rows of 1 to {AMX_GEMV_MAX_K} codes, got {k}")
        self.n, self.k, self.kp = int(n), int(k), -(-int(k) // 64) * 64
        self.panels = _streamed(amx_pack(lib, q))
        self.colsum128 = q.sum(1, dtype=torch.int32) * 128
        self._row_args: list = []  # row_call's argument structs (and scales), alive as long as this weight

    @staticmethod
    def codes(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """W [n, k] int8 from its panels: panel (nb, kb) row r byte 4c + j = W[16 nb + c][64 kb + 4 r + j]."""
        kb_n = -(-k // 64)
        p = panels.view(-1, kb_n, 16, 16, 4).permute(0, 3, 1, 2, 4)  # [nb, c, kb, r, j]
        return p.reshape(-1, kb_n * 64)[:n, :k].contiguous()

    def row_call(self, sw: torch.Tensor) -> int:
        """The address of this weight's arguments (and the weight scales sw [n] float32, held
        with them) for int8mm.c's fb_w8a8_amx_row(address, x, y): one contiguous float32 row x
        [k] quantized per token in C, then the one-row kernel, without a bias: what QuantLinear's
        general path computes for it, bit for bit. Valid while this object lives."""
        sw = sw.reshape(-1).to(torch.float32).contiguous()
        if sw.numel() != self.n:
            raise ValueError(f"sw needs {self.n} values, got {sw.numel()}")
        r = _W8A8Row(self.panels.data_ptr(), self.colsum128.data_ptr(), sw.data_ptr(), self.n, self.k)
        self._row_args.append((r, sw))
        return ctypes.addressof(r)

    def vnni_rows(self, m: int) -> bool:
        """Whether a batch of m rows runs the VNNI kernels (uint8 codes + 128), else the tiles (int8)."""
        return m == 1 or not self.tiles

    def matmul(self, lib: ctypes.CDLL, q: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """q [M, k]: uint8 codes + 128 where vnni_rows(M) (one row, or every batch without
        tiles: the VNNI kernels' operand), else int8 codes; sx [M] (or [1]), sw [n], bias [n] or
        None: float32 -> y [M, n] float32."""
        m = q.shape[0] if q.dim() == 2 else -1
        vnni = self.vnni_rows(m)
        if q.dim() != 2 or q.shape[1] != self.k or q.dtype != (torch.uint8 if vnni else torch.int8):
            raise ValueError(f"q must be [M, {self.k}], " + ("uint8 (+128)" if vnni else "int8") +
                             f" for {m} rows here; got {q.dtype} {tuple(q.shape)}")
        for v, sizes, name in ((sx, (m, 1), "sx"), (sw, (self.n,), "sw"), (bias, (self.n,), "bias")):
            if v is not None and (v.dtype != torch.float32 or v.numel() not in sizes):
                raise ValueError(f"{name} must be {sizes[0]} float32 values")
        bias = None if bias is None else bias.contiguous()  # held here while the C call reads it
        if vnni:
            # k padded to the panels' 64 with x's zeros (128); the panels' padding is zero anyway
            xu = q if self.kp == self.k else torch.nn.functional.pad(q, (0, self.kp - self.k), value=128)
            xu = xu.contiguous()
            y = torch.empty(m, self.n, dtype=torch.float32)
            bp = None if bias is None else bias.data_ptr()
            if m == 1:
                rc = lib.fb_amx_gemv_u8(xu.data_ptr(), self.kp, self.panels.data_ptr(), self.n,
                                        self.colsum128.data_ptr(), float(sx.reshape(-1)[0]), sw.data_ptr(), bp,
                                        y.data_ptr())
            else:
                sxm = sx.reshape(-1).expand(m).contiguous()
                rc = lib.fb_vnni_gemm_u8(xu.data_ptr(), m, self.kp, self.kp, self.panels.data_ptr(), self.n,
                                         self.colsum128.data_ptr(), sxm.data_ptr(), sw.data_ptr(), bp, y.data_ptr(),
                                         self.n)
        else:
            rc, y = _amx_gemm_panels(lib, q, self.panels, self.n, sx.reshape(-1).expand(m).contiguous(), sw, bias,
                                     torch.float32)
        if rc != 0:
            raise RuntimeError("the int8 panel kernels refused their arguments")
        return y


def amx_int8_gemm(lib: ctypes.CDLL, qa: torch.Tensor, qb: torch.Tensor, da: torch.Tensor | None,
                  db: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """(float32(qa @ qb.T) * da[:, None]) * db[None, :] (+ bias) in out_dtype (float32 / bfloat16),
    or the int32 sums (out_dtype int32); qa [M, K], qb [N, K] int8 CPU tensors, the factors
    float32 [M] / [N] or None. None when AMX is not there. Pads M to 32 and K to 64 with zeros."""
    if out_dtype not in _OUT_KINDS:
        raise ValueError(f"out_dtype must be float32, bfloat16 or int32, got {out_dtype}")
    for t, name in ((qa, "qa"), (qb, "qb")):
        if t.dtype != torch.int8 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"{name} must be a 2-D CPU int8 tensor, got {t.dtype} {tuple(t.shape)}")
    m, k = qa.shape
    n = qb.shape[0]
    if qb.shape[1] != k:
        raise ValueError(f"qa {tuple(qa.shape)} and qb {tuple(qb.shape)} differ in their reduction length")
    if m == 0 or n == 0 or k == 0:
        return None  # nothing to sum: the caller's torch path
    vecs = []
    for v, size, name in ((da, m, "da"), (db, n, "db"), (bias, n, "bias")):
        if v is not None:
            v = v.reshape(-1)
            if v.dtype != torch.float32 or v.numel() != size or v.device.type != "cpu":
                raise ValueError(f"{name} must be {size} float32 values on the CPU")
            v = v.contiguous()
        vecs.append(v)
    if not amx_int8_ready(lib):  # after the checks: bad operands are refused on every CPU
        return None
    rc, out = _amx_gemm_panels(lib, qa, amx_pack(lib, qb), n, *vecs, out_dtype)
    if rc != 0:
        return None
    return out


def q8_bf16(lib: ctypes.CDLL, x: torch.Tensor, contiguous: bool = True,
            seed: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and float32 scales of a bfloat16 matrix x [m, k] quantized along its rows
    (kernels.int8.quantize_rows_int8's arithmetic, nonfinite="keep"; with `seed`, stochastic
    rounding as kernels.int8.quantize_rows_int8(seed=...) defines it). x may be a transposed view
    (x.stride(0) == 1): its columns in memory are then the lines quantized. The codes come back
    contiguous, or with contiguous=False possibly as the transpose of a contiguous [k, m] (what
    the AMX GEMM packs directly)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"x must be a 2-D CPU bfloat16 tensor, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    scale = torch.empty(m, dtype=torch.float32)
    sd = None if seed is None else torch.tensor([int(seed[0]) & 0xFFFFFFFF, int(seed[1]) & 0xFFFFFFFF],
                                                dtype=torch.int64).to(torch.int32)
    sp = None if sd is None else sd.data_ptr()
    if x.stride(1) == 1 or m <= 1 or k <= 1:
        x = x if x.stride(1) == 1 else x.contiguous()
        q = torch.empty(m, k, dtype=torch.int8)
        lib.fb_q8_rows_bf16(x.data_ptr(), m, k, x.stride(0) if m > 1 else k, q.data_ptr(), k, scale.data_ptr(), sp)
        return q, scale
    base = x.t()  # [k, m], rows contiguous in memory when x is a transposed view
    if base.stride(1) != 1:
        base = base.contiguous()
    work = torch.empty(m, dtype=torch.float32)
    if contiguous:  # q [m, k]: the transpose written out
        q = torch.empty(m, k, dtype=torch.int8)
        lib.fb_q8_cols_bf16(base.data_ptr(), k, m, base.stride(0), q.data_ptr(), k, 1, scale.data_ptr(),
                            work.data_ptr(), sp)
        return q, scale
    qt = torch.empty(k, m, dtype=torch.int8)
    lib.fb_q8_cols_bf16(base.data_ptr(), k, m, base.stride(0), qt.data_ptr(), m, 0, scale.data_ptr(),
                        work.data_ptr(), sp)
    return qt.t(), scale


def lut4_supported(row_len: int, group: int) -> bool:
    """Whether fb_lut4_matmul takes rows of `row_len` codes in groups of `group`."""
    return row_len % 32 == 0 and group % 16 == 0 and group >= 16 and row_len % group == 0


class _Lut4Params(ctypes.Structure):
    """lut4.c's Params: per-group scales (or byte codes of them), zero points, minimums."""
    _fields_ = [("s", ctypes.c_void_p), ("z", ctypes.c_void_p), ("m", ctypes.c_void_p),
                ("s_kind", ctypes.c_int32), ("z_kind", ctypes.c_int32), ("m_kind", ctypes.c_int32),
                ("s_codes", ctypes.c_void_p), ("s_table", ctypes.c_void_p), ("s_mul", ctypes.c_float)]


def tiles(lib: ctypes.CDLL) -> bool:
    """Whether this build has tiles.h's fused bfloat16 batch multiply (on AMX tiles where the CPU
    has AMX-BF16 and Linux granted the tiles' state, else with AVX512-BF16 dot products):
    Lut4Weight.tile_matmul and Int8Weight.tile_matmul return None where not."""
    return tiles_kind(lib) > 0


def tiles_kind(lib: ctypes.CDLL) -> int:
    """How tiles.h's batch multiply runs here: 2 on AMX tiles, 1 with AVX512-BF16 dot products,
    0 not at all."""
    return int(lib.fb_tiles())


def lut4_rc(rc: int) -> None:
    """Raise for a non-zero return code of fb_lut4_matmul / fb_lut4_row / fb_lut4_tile_matmul."""
    if rc:
        raise (MemoryError("the lut4 kernel could not allocate its copy of x or its scratch") if rc == -2
               else RuntimeError("the lut4 kernel refused its arguments"))


class _Lut4Row(ctypes.Structure):
    """lut4.c's Lut4Row: a weight's fixed arguments of fb_lut4_matmul for one row of x."""
    _fields_ = [("codes", ctypes.c_void_p), ("P", ctypes.c_void_p), ("table", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("group", ctypes.c_int64), ("kx", ctypes.c_int64)]


_PARAM_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # lut4.c's P_F32, P_F16, P_BF16


class Lut4Weight:
    """A weight W [n, row_len] of 4-bit codes of a 16-value table with per-group parameters
    (`group` columns each), W[r, c] = ((table[code] - zero_point) * scale) + minimum, each
    operation one float32 rounding (QuantizedTensor.dequantize()'s; no zero point / minimum
    where None), prepared for lut4.c: the arguments are checked and converted once, so that a
    call costs one C call.

    codes: uint8, packed low-first, row_len / 2 bytes per row. scales, zero_points, minimums:
    [n or 1, groups] in float32, float16 or bfloat16 (read as they are stored; zero points as
    float values). The scales may instead be a tuple (byte codes [n, groups], float32 table
    [256], multiplier), each scale table[code] * multiplier (one float32 product: MX, NVFP4).
    The tensors are referenced, not copied, where they already have the layout the C code
    reads (n rows, contiguous). huge_pages: put the codes on transparent huge pages
    (kernels/hugepages.py); leave it False for a weight built for one call."""

    def __init__(self, codes: torch.Tensor, scales, table: torch.Tensor, n: int, row_len: int, group: int,
                 zero_points: torch.Tensor | None = None, minimums: torch.Tensor | None = None,
                 huge_pages: bool = True):
        if not lut4_supported(row_len, group):
            raise ValueError(f"rows of {row_len} codes in groups of {group}: need multiples of 32 and 16")
        if codes.dtype != torch.uint8 or codes.numel() < n * row_len // 2 or codes.device.type != "cpu":
            raise ValueError(f"codes must be CPU uint8 with at least {n * row_len // 2} bytes")
        if table.device.type != "cpu":
            raise ValueError("the table must be a CPU tensor")
        self.n, self.row_len, self.group = int(n), int(row_len), int(group)
        groups = row_len // group
        self._keep = []
        p = _Lut4Params()
        if isinstance(scales, tuple):
            scale_codes, scale_table, scale_mul = scales
            scale_codes = scale_codes.reshape(-1).contiguous()
            scale_table = scale_table.to(torch.float32).contiguous()
            if (scale_codes.dtype != torch.uint8 or scale_codes.numel() != n * groups or scale_table.numel() != 256
                    or scale_codes.device.type != "cpu" or scale_table.device.type != "cpu"):
                raise ValueError(f"coded scales need {n * groups} CPU byte codes and a CPU table of 256 values")
            self._keep += [scale_codes, scale_table]
            p.s_codes, p.s_table, p.s_mul = scale_codes.data_ptr(), scale_table.data_ptr(), float(scale_mul)
        else:
            p.s, p.s_kind = self._param(scales, n, groups, "scales")
        if zero_points is not None:
            p.z, p.z_kind = self._param(zero_points, n, groups, "zero_points")
        if minimums is not None:
            p.m, p.m_kind = self._param(minimums, n, groups, "minimums")
        self._params = p
        self._params_ref = ctypes.byref(p)
        table = table.to(torch.float32).contiguous()
        if table.numel() != 16:
            raise ValueError(f"the table needs 16 values, got {table.numel()}")
        self._table = table
        self._codes = codes.contiguous()
        if huge_pages:  # False for a weight built for one call: a madvise per call is no use
            self.huge_pages()
        self._row_args: list = []  # row_call's argument structs, alive as long as this weight

    def huge_pages(self) -> None:
        """The codes on transparent huge pages, as _streamed puts them (once, for a weight kept)."""
        _streamed(self._codes)

    def _param(self, t: torch.Tensor, n: int, groups: int, what: str) -> tuple[int, int]:
        if not isinstance(t, torch.Tensor) or t.dtype not in _PARAM_KINDS or t.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU float32, float16 or bfloat16 tensor")
        if t.numel() not in (groups, n * groups):
            raise ValueError(f"{what} needs {groups} or {n * groups} values, got {t.numel()}")
        t = t.reshape(-1, groups).expand(n, groups).contiguous()
        self._keep.append(t)
        return t.data_ptr(), _PARAM_KINDS[t.dtype]

    def own_nbytes(self, others) -> int:
        """Bytes of the tensors this weight holds that share no storage with any of `others`
        (the QuantizedTensor's own tensors): what it derived, e.g. float32 zero points."""
        ptrs = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
        return sum(t.nbytes for t in self._keep if t.untyped_storage().data_ptr() not in ptrs)

    def matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k <= row_len] float32 @ W.T -> [M, n] float32 (columns from k on are padding:
        x is read as zero there). The output rows are shared out over torch's OpenMP threads
        (where the library was built with OpenMP). Within float32 summation error of x @ the
        decoded weight; one row with AVX-512 and groups of 16, 32 or 64 (no zero points or
        minimums) sums table value times x per 8 columns and multiplies by the scale once
        (lut4.c's one_row; a row with an infinite or NaN scale takes each weight's product first,
        as decoding does), every other case multiplies x by the decoded weights."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] > self.row_len or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, <= {self.row_len}], got {x.dtype} {tuple(x.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        lut4_rc(lib.fb_lut4_matmul(x.data_ptr(), x.stride(0), x.shape[1], self._codes.data_ptr(), self._params_ref,
                                   self._table.data_ptr(), m, self.n, self.row_len, self.group, y.data_ptr()))
        return y

    def tile_matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, k <= row_len] (bfloat16, or float32 rounded to bfloat16 in the call: to nearest
        even, subnormals to zero, see tiles.h) @ bf16(W).T -> [M, n] float32 on AMX tiles (lut4.c's
        fb_lut4_tile_matmul): W decoded to bfloat16 as decode(..., torch.bfloat16) gives it (for
        groups of 16 or a multiple of 32 by the hardware's conversion, which takes float32
        subnormals to zero), 32 rows at a time into a buffer in the caches, the exact products of
        bfloat16 numbers summed in float32 (TDPBF16PS: subnormal bfloat16 inputs read as zero, as
        in oneDNN's bfloat16 GEMM). None where the tiles cannot be used (no AMX in this build, or
        Linux refused them): the caller takes another path."""
        if (x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.shape[1] > self.row_len
                or x.device.type != "cpu"):
            raise ValueError(f"x must be CPU bfloat16 or float32 [M, <= {self.row_len}], got {x.dtype} {tuple(x.shape)}")
        if not tiles(lib):  # nothing allocated or copied for a call that cannot run
            return None
        if x.stride(1) != 1 or x.stride(0) < x.shape[1]:
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        rc = lib.fb_lut4_tile_matmul(x.data_ptr(), int(x.dtype == torch.float32), max(x.stride(0), x.shape[1]),
                                     x.shape[1], self._codes.data_ptr(), self._params_ref, self._table.data_ptr(), m,
                                     self.n, self.row_len, self.group, y.data_ptr())
        if rc == -3:
            return None
        lut4_rc(rc)
        return y

    def row_call(self, kx: int) -> int:
        """The address of this weight's arguments for lut4.c's fb_lut4_row(address, x, y): y [n] =
        x [kx] @ W.T for one contiguous float32 row x, what matmul() computes for it, bit for bit,
        in one C call of three arguments. Valid while this weight lives."""
        if not 0 <= kx <= self.row_len:
            raise ValueError(f"kx must be in [0, {self.row_len}], got {kx}")
        r = _Lut4Row(self._codes.data_ptr(), ctypes.addressof(self._params), self._table.data_ptr(),
                     self.n, self.row_len, self.group, int(kx))
        self._row_args.append(r)
        return ctypes.addressof(r)

    def decode(self, lib: ctypes.CDLL, r0: int, r1: int, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0..r1 of W decoded to [r1 - r0, row_len] (padding columns included): float32
        bit-identical to QuantizedTensor.dequantize(), or bfloat16 equal to that float32
        weight's .to(torch.bfloat16) for numbers (round to nearest even; NaN -> 0x7FC0).
        `out`: a contiguous CPU tensor of at least that many values to decode into (its first
        ones; a buffer reused from block to block spares the page faults of fresh memory)."""
        if not 0 <= r0 <= r1 <= self.n:
            raise ValueError(f"rows {r0}..{r1} out of 0..{self.n}")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"lut4 decodes to float32 or bfloat16, not {dtype}")
        count = (r1 - r0) * self.row_len
        if out is None:
            out = torch.empty(r1 - r0, self.row_len, dtype=dtype)
        else:
            if out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < count:
                raise ValueError(f"out must be a contiguous CPU {dtype} tensor of at least {count} values")
            out = out.reshape(-1)[:count].view(r1 - r0, self.row_len)
        rc = lib.fb_lut4_decode(self._codes.data_ptr(), self._params_ref, self._table.data_ptr(), self.row_len,
                                self.group, r0, r1, out.data_ptr(), 1 if dtype == torch.bfloat16 else 0)
        if rc:
            raise (MemoryError("fb_lut4_decode could not allocate its scratch") if rc == -2
                   else RuntimeError("fb_lut4_decode refused its arguments"))
        return out


# --- int4 x int8 dot products (w4a8.c) ------------------------------------------------------
NONFINITE_ACTIVATIONS = "the activations contain NaN or inf, which dynamic int8 quantization cannot represent"


def _w4a8_rc(rc: int, what: str) -> None:
    """Raise for w4a8.c's return codes: -3 NaN / inf activations, -2 no memory, -1 refused."""
    if rc == -3:
        raise ValueError(NONFINITE_ACTIVATIONS)
    if rc == -2:
        raise MemoryError(f"{what} could not allocate its scratch")
    if rc:
        raise RuntimeError(f"{what} refused its arguments")


def w4a8_row_rc(rc: int) -> None:
    """Raise for a non-zero return code of fb_w4a8_row (fb_w4a8_linear's)."""
    _w4a8_rc(rc, "fb_w4a8_linear")


class _W4A8Row(ctypes.Structure):
    """w4a8.c's W4A8Row: a weight's fixed arguments of fb_w4a8_linear for one row of x."""
    _fields_ = [("codes", ctypes.c_void_p), ("s", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("s_kind", ctypes.c_int64), ("m_kind", ctypes.c_int64), ("is_signed", ctypes.c_int64),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


def _w4a8_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """(x, its row stride) for w4a8.c, which reads rows of k values at that stride: broadcast or
    overlapping rows copied dense; a single row's stride is k, whatever torch says."""
    m = x.shape[0]
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < k):
        x = x.contiguous()
    return x, (x.stride(0) if m > 1 else k)


def w4a8_dequantized_x(lib: ctypes.CDLL, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [M, K] float32 quantized per block of 32 columns as W4A8Weight.linear does, then
    dequantized: xq * sx in float32, equal to fewbits.quant.quantize(x, int8 group-32 absmax
    scheme).dequantize(); with dtype=torch.bfloat16 that float32 rounded to bfloat16 (nearest
    even, as .to(torch.bfloat16) does), in the same pass. ValueError where x holds NaN or inf."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32 or x.shape[1] == 0 or x.device.type != "cpu":
        raise ValueError(f"x must be CPU float32 [M, K] with K a positive multiple of 32, got {x.dtype} {tuple(x.shape)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
    m, k = x.shape
    x, ldx = _w4a8_rows(x, k)
    out = torch.empty(m, k, dtype=dtype)
    if m == 0:
        return out
    _w4a8_rc(lib.fb_w4a8_dequantized_x(x.data_ptr(), ldx, m, k, out.data_ptr(), int(dtype == torch.bfloat16)),
             "fb_w4a8_dequantized_x")
    return out


class W4A8Weight:
    """A weight W [n, k] of 4-bit integer codes in groups of 32 columns, each group with a float
    scale s (and, for uint4 codes, a float minimum mn): w = s * (c) for signed int4 codes c, w =
    s * u + mn for uint4 codes u -- prepared for w4a8.c's int4 x int8 dot products, which take
    activations quantized per block of 32 columns (int8 codes, float32 scales) and sum the
    products of codes exactly (see w4a8.c for the float32 operations around them).

    codes: uint8 [n, k / 2], low nibble first. scales, minimums: [n, k / 32] float32, float16 or
    bfloat16, referenced as stored (no copy where contiguous)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, n: int, k: int, signed: bool,
                 minimums: torch.Tensor | None = None):
        n, k = int(n), int(k)
        if k <= 0 or k % 32:
            raise ValueError(f"w4a8 takes rows of a multiple of 32 columns, got {k}")
        if codes.dtype != torch.uint8 or codes.device.type != "cpu" or codes.numel() != n * k // 2:
            raise ValueError(f"codes must be CPU uint8 with {n * k // 2} bytes")
        if signed and minimums is not None:
            raise ValueError("signed int4 codes take no minimums")
        self.n, self.k, self.signed = n, k, bool(signed)
        self._codes = _streamed(codes.reshape(-1).contiguous())
        self._scales, self._s_kind = self._param(scales, n, k // 32, "scales")
        self._mins, self._m_kind = (None, 0) if minimums is None else self._param(minimums, n, k // 32, "minimums")
        self._row_args: list = []  # row_call's argument structs, alive as long as this weight
        # fb_w4a8_linear's arguments after x's (the tensors above are held, so the pointers stay)
        self._args = (self._codes.data_ptr(), self._scales.data_ptr(), self._s_kind,
                      self._mins.data_ptr() if self._mins is not None else None, self._m_kind,
                      1 if self.signed else 0, self.n, self.k)

    def row_call(self) -> int:
        """The address of this weight's arguments for w4a8.c's fb_w4a8_row(address, x, y): y [n]
        for one contiguous float32 row x [k], what linear() computes for it, bit for bit, in one C
        call of three arguments (return codes as fb_w4a8_linear's: w4a8_row_rc). Valid while
        this weight lives."""
        c, s, sk, mn, mk, signed, n, k = self._args
        r = _W4A8Row(c, s, mn, sk, mk, signed, n, k)
        self._row_args.append(r)
        return ctypes.addressof(r)

    @staticmethod
    def _param(t, n: int, groups: int, what: str):
        if not isinstance(t, torch.Tensor) or t.dtype not in _PARAM_KINDS or t.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU float32, float16 or bfloat16 tensor")
        if t.numel() != n * groups:
            raise ValueError(f"{what} needs {n * groups} values, got {t.numel()}")
        return t.reshape(-1).contiguous(), _PARAM_KINDS[t.dtype]

    def own_nbytes(self, others) -> int:
        """Bytes this weight holds that share no storage with `others` (copies it had to make)."""
        ptrs = {t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor)}
        held = [t for t in (self._codes, self._scales, self._mins) if t is not None]
        return sum(t.nbytes for t in held if t.untyped_storage().data_ptr() not in ptrs)

    def matmul(self, lib: ctypes.CDLL, xq: torch.Tensor, sx: torch.Tensor, force_scalar: bool = False) -> torch.Tensor:
        """xq [M, k] int8 codes and sx [M, k / 32] float32 block scales of the activations ->
        y [M, n] float32 (see w4a8.c)."""
        if (xq.dtype != torch.int8 or xq.dim() != 2 or xq.shape[1] != self.k or xq.device.type != "cpu"
                or sx.dtype != torch.float32 or tuple(sx.shape) != (xq.shape[0], self.k // 32) or sx.device.type != "cpu"):
            raise ValueError(f"xq must be CPU int8 [M, {self.k}] and sx float32 [M, {self.k // 32}], got "
                             f"{xq.dtype} {tuple(xq.shape)} and {sx.dtype} {tuple(sx.shape)}")
        xq, sx = xq.contiguous(), sx.contiguous()
        m = xq.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0 or self.n == 0:
            return y
        mins = self._mins.data_ptr() if self._mins is not None else None
        _w4a8_rc(lib.fb_w4a8_matmul(xq.data_ptr(), sx.data_ptr(), m, self._codes.data_ptr(), self._scales.data_ptr(),
                                    self._s_kind, mins, self._m_kind, 1 if self.signed else 0, self.n, self.k,
                                    y.data_ptr(), 1 if force_scalar else 0), "fb_w4a8_matmul")
        return y

    def linear(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k] float32 -> y [M, n] float32: x quantized per block of 32 columns (int8,
        float32 scales amax / 127, as fewbits.quant.quantize does) inside the same C call, then
        matmul(). ValueError where x holds NaN or inf (which that quantization cannot represent)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        m = x.shape[0]
        x, ldx = _w4a8_rows(x, self.k)
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m == 0 or self.n == 0:
            return y
        _w4a8_rc(lib.fb_w4a8_linear(x.data_ptr(), ldx, m, *self._args, y.data_ptr()), "fb_w4a8_linear")
        return y


# --- int8 weight-only layers (int8w.c) ----------------------------------------------------
def int8w_rc(rc: int) -> None:
    """Raise for a non-zero return code of fb_int8w_matmul / fb_int8w_row / fb_int8w_tile_matmul."""
    if rc:
        raise (MemoryError("the int8 kernel could not allocate its buffers") if rc == -2
               else RuntimeError("the int8 kernel refused its arguments"))


class _Int8WRow(ctypes.Structure):
    """int8w.c's Int8WRow: a weight's fixed arguments of fb_int8w_matmul for one row of x."""
    _fields_ = [("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


class Int8Weight:
    """An int8 weight-only layer's weight W = q * s (codes q [n, k] int8, one float32 scale per
    row) prepared for int8w.c: x [M <= max_rows(lib), k] float32 @ W.T as each row's float32 sum
    of q * x times its scale (see int8w.c). The tensors are referenced, not copied, where they are
    contiguous already."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or q.device.type != "cpu" or q.shape[1] == 0:
            raise ValueError(f"q must be a CPU int8 matrix [n, k > 0], got {q.dtype} {tuple(q.shape)}")
        n, k = q.shape
        if scales.numel() != n or scales.device.type != "cpu" or not scales.is_floating_point():
            raise ValueError(f"scales must be {n} CPU float values")
        self.n, self.k = int(n), int(k)
        self._q = _streamed(q.contiguous())
        self._s = scales.reshape(-1).to(torch.float32).contiguous()
        self._row_args: list = []

    @staticmethod
    def max_rows(lib: ctypes.CDLL) -> int:
        return int(lib.fb_int8w_max_rows())

    def matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
        """x [M, k] float32 (M <= max_rows) -> y [M, n] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be CPU float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if not 0 <= x.shape[0] <= self.max_rows(lib):
            raise ValueError(f"x may have at most {self.max_rows(lib)} rows, got {x.shape[0]}")
        if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.k):
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        ldx = x.stride(0) if m > 1 else self.k
        int8w_rc(lib.fb_int8w_matmul(x.data_ptr(), ldx, m, self._q.data_ptr(), self._s.data_ptr(), self.n, self.k,
                                     y.data_ptr()))
        return y

    def tile_matmul(self, lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, k] (bfloat16, or float32 rounded to bfloat16 in the call, see Lut4Weight's) @ q.T
        on AMX tiles (int8w.c's fb_int8w_tile_matmul): each output the float32 sum of the exact
        products of x and the codes (TDPBF16PS, see tiles.h) times its row's scale -> [M, n]
        float32; None where the tiles cannot be used (no AMX in this build, or Linux refused
        them)."""
        if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu":
            raise ValueError(f"x must be CPU bfloat16 or float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if not tiles(lib):  # nothing allocated or copied for a call that cannot run
            return None
        if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < self.k):
            x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, self.n, dtype=torch.float32)
        rc = lib.fb_int8w_tile_matmul(x.data_ptr(), int(x.dtype == torch.float32), x.stride(0) if m > 1 else self.k, m,
                                      self._q.data_ptr(), self._s.data_ptr(), self.n, self.k, y.data_ptr())
        if rc == -3:
            return None
        int8w_rc(rc)
        return y

    def row_call(self) -> int:
        """The address of this weight's arguments for int8w.c's fb_int8w_row(address, x, y): y [n]
        for one contiguous float32 row x [k], what matmul() computes for it, bit for bit. Valid
        while this weight lives."""
        r = _Int8WRow(self._q.data_ptr(), self._s.data_ptr(), self.n, self.k)
        self._row_args.append(r)
        return ctypes.addressof(r)


# --- rounding of float32 values (round32.c) ------------------------------------------------
def _check_flat(x: torch.Tensor, out: torch.Tensor) -> None:
    for t in (x, out):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"native rounding takes contiguous CPU float32 tensors, got {t.dtype} {t.device}")
    if out.numel() != x.numel():
        raise ValueError(f"out has {out.numel()} values for {x.numel()}")


FLOAT_KINDS = ("scaled", "fixed", "pow2")  # round32.c's kind numbers


def round_float_f32(lib, x: torch.Tensor, out: torch.Tensor, params: torch.Tensor, kind: str, mode: int,
                    seed) -> torch.Tensor:
    """x rounded into out by floatround's kernel `kind` (scaled, fixed or pow2) and its finishing
    step; params: int32, round32.c's P_* layout; mode: the index in fewbits.formats.MODES;
    seed: the pair of 31-bit seeds (stochastic rounding)."""
    _check_flat(x, out)
    rc = lib.fb_round_float_f32(x.data_ptr(), out.data_ptr(), x.numel(), params.data_ptr(), FLOAT_KINDS.index(kind),
                                int(mode), int(seed[0]), int(seed[1]))
    if rc != 0:
        raise ValueError(f"fb_round_float_f32 refused kind {kind!r}, mode {mode}")
    return out


def round_lut_f32(lib, x: torch.Tensor, out: torch.Tensor, thresholds: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """values[#{j: x > thresholds[j]}] (NaN for NaN) into out; float32 thresholds (<= 15,
    ascending) and values (one more)."""
    _check_flat(x, out)
    lib.fb_round_lut_f32(x.data_ptr(), out.data_ptr(), x.numel(), thresholds.data_ptr(), thresholds.numel(),
                         values.data_ptr())
    return out


def round_lut_sr_f32(lib, x: torch.Tensor, out: torch.Tensor, th_down: torch.Tensor, values: torch.Tensor,
                     seed) -> torch.Tensor:
    """Stochastic rounding to the codebook `values` (th_down: x > th_down[j] <=> x >= values[j+1])."""
    _check_flat(x, out)
    lib.fb_round_lut_sr_f32(x.data_ptr(), out.data_ptr(), x.numel(), th_down.data_ptr(), th_down.numel(),
                            values.data_ptr(), int(seed[0]), int(seed[1]))
    return out



# --- k-quant scale searches (kquant.c) -------------------------------------------------------
KQUANT_MAX_GROUP = 256  # kquant.c's longest group


def kquant_supported(g: torch.Tensor, valid) -> bool:
    """Whether kquant.c takes this group view: CPU float32 [rows, groups, n], 1 <= n <= 256,
    a mask (if any) of shape [1, groups, n]."""
    return (g.device.type == "cpu" and g.dtype == torch.float32 and g.dim() == 3
            and 1 <= g.shape[-1] <= KQUANT_MAX_GROUP
            and (valid is None or tuple(valid.shape) == (1, *g.shape[1:])))


def _kquant_args(g: torch.Tensor, valid):
    if not kquant_supported(g, valid):
        raise ValueError(f"kquant kernels take a CPU float32 group view [rows, groups, n <= {KQUANT_MAX_GROUP}] "
                         f"and a mask [1, groups, n], got {g.dtype} {g.device} {tuple(g.shape)}")
    g = g.contiguous()
    mask = None if valid is None else valid.reshape(g.shape[1:]).to(torch.uint8).contiguous()
    return g, mask, g.shape[0] * g.shape[1], g.shape[1], g.shape[2]


def _f64(values) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def kquant_float_min(lib, g: torch.Tensor, valid, nmax: float, candidates) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, -minimum) float64 [rows, groups] of the k-quants' float-minimum search
    (fewbits.quant.scales._float_min_params with scale_method "mse"); candidates: the
    constants c of the candidate scales c / (max - min)."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    cands = _f64(candidates)
    scale = torch.empty(g.shape[:2], dtype=torch.float64)
    negmin = torch.empty(g.shape[:2], dtype=torch.float64)
    lib.fb_kquant_float_min(g.data_ptr(), count, groups, n, mask.data_ptr() if mask is not None else None,
                            float(nmax), cands.data_ptr(), cands.numel(), scale.data_ptr(), negmin.data_ptr())
    return scale, negmin


def kquant_symmetric(lib, g: torch.Tensor, valid, lowest: float, top: float, candidates) -> torch.Tensor:
    """The signed scale float64 [rows, groups] of the k-quants' symmetric search
    (fewbits.quant.scales._symmetric_params with "mse"); candidates: the constants c of the
    candidate scales c / (the value of largest magnitude), the first one the plain range."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    cands = _f64(candidates)
    scale = torch.empty(g.shape[:2], dtype=torch.float64)
    lib.fb_kquant_symmetric(g.data_ptr(), count, groups, n, mask.data_ptr() if mask is not None else None,
                            float(lowest), float(top), cands.data_ptr(), cands.numel(), scale.data_ptr())
    return scale


def kquant_refine(lib, g: torch.Tensor, valid, lo_q: float, hi_q: float, de, code_pair, dme=None, min_pair=None):
    """(sub-scale codes, sub-minimum codes or None) float64 [rows, groups]: of the code pairs
    code_pair x min_pair (float64 [rows, groups] each) under the super-block scales de (dme),
    the one of least weighted squared error (fewbits.quant.scales._refine_codes)."""
    g, mask, count, groups, n = _kquant_args(g, valid)
    float_min = min_pair is not None
    shape = tuple(g.shape[:2])

    def f64(t):
        t = t.to(torch.float64).contiguous()
        if tuple(t.shape) != shape:
            raise ValueError(f"kquant_refine: a code or scale tensor of shape {tuple(t.shape)}, expected {shape}")
        return t

    keep = [f64(de), *(f64(c) for c in code_pair)]
    if float_min:
        keep += [f64(dme), *(f64(c) for c in min_pair)]
    best_s = torch.empty(shape, dtype=torch.float64)
    best_m = torch.empty(shape, dtype=torch.float64) if float_min else None
    ptr = [t.data_ptr() for t in keep] + ([None, None, None] if not float_min else [])
    lib.fb_kquant_refine(g.data_ptr(), count, groups, n, mask.data_ptr() if mask is not None else None,
                         1 if float_min else 0, float(lo_q), float(hi_q), *ptr, best_s.data_ptr(),
                         best_m.data_ptr() if best_m is not None else None)
    return best_s, best_m


# --- one decode step of a Llama-architecture model (decode.c) --------------------------------
def declare_decode(lib: ctypes.CDLL) -> None:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.fb_decode_step.argtypes = [p, p, i64]
    lib.fb_decode_step.restype = ctypes.c_int32
    lib.fb_decode_rms_norm.argtypes = [p, p, f32, i64, p]
    lib.fb_decode_rms_norm.restype = None
    lib.fb_decode_rope.argtypes = [p, i64, i64, p, p]
    lib.fb_decode_rope.restype = None
    lib.fb_decode_attend.argtypes = [p, p, p, i64, i64, i64, i64, i64, f32, p, p]
    lib.fb_decode_attend.restype = None
    lib.fb_decode_silu_mul.argtypes = [p, p, i64]
    lib.fb_decode_silu_mul.restype = None
    lib.fb_decode_exp.argtypes = [p, i64, p]
    lib.fb_decode_exp.restype = None


def function_address(lib: ctypes.CDLL, name: str) -> int:
    """The address of one of the library's functions, for C code that calls it (RowKernel)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@dataclasses.dataclass(frozen=True)
class RowKernel:
    """A layer's one-row C call, y [out] = f(args, x [in]) (+ bias): the address of a function
    of this library taking (const void *args, const float *x, float *y) and returning an int32
    code, its argument address, the code's check (raises for non-zero), a float32 bias or None,
    and what keeps the arguments alive (the prepared weight)."""

    function: int
    args: int
    check: Callable[[int], None]
    bias: torch.Tensor | None
    in_features: int
    out_features: int
    keep: object


class _DecLin(ctypes.Structure):
    _fields_ = [("fn", ctypes.c_void_p), ("args", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64)]


DECODE_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
DECODE_MAX_HEAD_DIM = 512  # decode.c's rotary buffer


def decode_heads_ok(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether fb_decode_step takes these attention shapes."""
    return 2 <= head_dim <= DECODE_MAX_HEAD_DIM and head_dim % 2 == 0 and kv_heads >= 1 and heads % kv_heads == 0


class _DecLayer(ctypes.Structure):
    _fields_ = [(n, _DecLin) for n in DECODE_LINEARS] + [
        ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float)]


class _DecModel(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_int64) for n in ("layers", "d", "heads", "kv_heads", "head_dim", "inter", "capacity")]
                + [("layer", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                   ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("scaling", ctypes.c_float),
                   ("norm_f", ctypes.c_void_p), ("eps_f", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("x", "q", "k", "v", "att", "g", "u", "o", "scores")]
                + [("failed_layer", ctypes.c_int64), ("failed_linear", ctypes.c_int64)])


def _f32_vector(t, n: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu" or t.numel() != n:
        raise ValueError(f"{what} must be a CPU float32 tensor of {n} values")
    return t.detach().reshape(-1).contiguous()


class DecodeStep:
    """decode.c's fb_decode_step over one model: every layer of a Llama-architecture decoder for
    one token in one C call (see decode.c), the linear layers through their RowKernels.

    layers: per layer a dict of RowKernels q, k, v, o, gate, up, down and the float32 RMSNorm
    weights norm1, norm2 with their eps1, eps2. k_cache, v_cache: float32 contiguous [layers, 1,
    kv_heads, capacity, head_dim], written at each step's position. cos, sin: float32
    [capacity, head_dim], the rotary embedding of each position. Shapes are checked here, once;
    the tensors are held for the object's life.
    """

    def __init__(self, lib: ctypes.CDLL, layers: list[dict], norm_f: torch.Tensor, eps_f: float,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 heads: int, kv_heads: int, head_dim: int, scaling: float):
        if not layers:
            raise ValueError("a decode step needs at least one layer")
        if not decode_heads_ok(heads, kv_heads, head_dim):
            raise ValueError(f"unsupported heads {heads}, kv heads {kv_heads}, head_dim {head_dim}")
        first = layers[0]
        if not all(isinstance(first.get(n), RowKernel) for n in ("q", "gate")):
            raise ValueError("layer 0 q and gate must be RowKernels")
        d = first["q"].in_features
        inter = first["gate"].out_features
        want = {"q": (d, heads * head_dim), "k": (d, kv_heads * head_dim), "v": (d, kv_heads * head_dim),
                "o": (heads * head_dim, d), "gate": (d, inter), "up": (d, inter), "down": (inter, d)}
        shape = (len(layers), 1, kv_heads, k_cache.shape[3] if k_cache.dim() == 5 else -1, head_dim)
        capacity = shape[3]
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (c.dtype != torch.float32 or c.device.type != "cpu" or tuple(c.shape) != shape or capacity < 1
                    or not c.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous CPU float32 tensor [layers, 1, kv_heads, capacity, "
                                 f"head_dim] = {shape}, got {c.dtype} {tuple(c.shape)}")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != torch.float32 or tuple(t.shape) != (capacity, head_dim) or t.device.type != "cpu":
                raise ValueError(f"{name} must be CPU float32 [{capacity}, {head_dim}], got {t.dtype} {tuple(t.shape)}")
        self._keep: list = [k_cache, v_cache]
        self._layers = (_DecLayer * len(layers))()
        self.kernels: list[dict] = []
        for i, spec in enumerate(layers):
            entry = self._layers[i]
            for name in DECODE_LINEARS:
                rk = spec[name]
                if not isinstance(rk, RowKernel) or (rk.in_features, rk.out_features) != want[name]:
                    got = (rk.in_features, rk.out_features) if isinstance(rk, RowKernel) else type(rk).__name__
                    raise ValueError(f"layer {i} {name}: a RowKernel of (in, out) = {want[name]} expected, got {got}")
                bias = None if rk.bias is None else _f32_vector(rk.bias, rk.out_features, f"layer {i} {name}'s bias")
                self._keep += [rk.keep, bias]
                setattr(entry, name, _DecLin(rk.function, rk.args, bias.data_ptr() if bias is not None else None,
                                             rk.out_features))
            for k in ("norm1", "norm2"):
                w = _f32_vector(spec[k], d, f"layer {i} {k}")
                self._keep.append(w)
                setattr(entry, k, w.data_ptr())
            entry.eps1, entry.eps2 = float(spec["eps1"]), float(spec["eps2"])
            self.kernels.append({name: spec[name] for name in DECODE_LINEARS})
        norm_f = _f32_vector(norm_f, d, "the final norm's weight")
        cos, sin = cos.contiguous(), sin.contiguous()
        sizes = {"x": d, "q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim,
                 "att": heads * head_dim, "g": inter, "u": inter, "o": d, "scores": heads * capacity}
        self._scratch = {n: torch.empty(v, dtype=torch.float32) for n, v in sizes.items()}
        self._keep += [norm_f, cos, sin]
        self._model = _DecModel(len(layers), d, heads, kv_heads, head_dim, inter, capacity,
                                ctypes.addressof(self._layers), k_cache.data_ptr(), v_cache.data_ptr(),
                                cos.data_ptr(), sin.data_ptr(), float(scaling), norm_f.data_ptr(), float(eps_f),
                                *(self._scratch[n].data_ptr() for n in sizes), -1, -1)
        self._address = ctypes.addressof(self._model)
        self._lib = lib
        self.d, self.capacity = d, capacity
        self.out = self._scratch["x"]  # the final norm of the last step's hidden state

    def __call__(self, h: torch.Tensor, pos: int) -> torch.Tensor:
        """h [d] float32 contiguous (the token's embedding, overwritten with the last layer's
        output) at position pos -> the final RMSNorm of it, [d] (self.out: the next call
        overwrites it)."""
        if h.dtype != torch.float32 or h.numel() != self.d or not h.is_contiguous() or h.device.type != "cpu":
            raise ValueError(f"h must be a contiguous CPU float32 tensor of {self.d} values")
        if not 0 <= pos < self.capacity:
            raise ValueError(f"position {pos} is outside the cache's {self.capacity} positions")
        rc = self._lib.fb_decode_step(self._address, h.data_ptr(), pos)
        if rc:
            m = self._model
            if m.failed_layer >= 0:
                self.kernels[m.failed_layer][DECODE_LINEARS[m.failed_linear]].check(rc)
            raise RuntimeError(f"the decode step refused its arguments (code {rc})")
        return self.out
