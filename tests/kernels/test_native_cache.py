"""The native library's cache is trusted only as far as it is the current user's alone (issue 12,
items 1 and 2): a library planted where another user can write -- a directory or file of another
owner, or writable by group or others, or a symbolic link -- is refused with one warning and
its constructor never runs; a truncated, empty or garbage library, or one that does not match
the SHA-256 recorded at its build, is rebuilt and never loaded (a truncated one used to kill
every later process with SIGBUS); leftovers of killed builds are removed, a concurrent build's
files are not.

One real build per module (the `built` fixture); the tests that rebuild swap the compiler for a
copy of those bytes (`fake_compiler`): what they test is the cache, not the compiler."""
import hashlib
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from fewbits.kernels.native import loader as native

HAVE_CC = native._compiler() is not None
pytestmark = pytest.mark.skipif(not HAVE_CC or not os.path.isdir("/proc/self/fd"),
                                reason="needs a C compiler and /proc/self/fd")

FOREIGN_UID = 12345
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *p = getenv("FEWBITS_TEST_MARKER");
    FILE *f = p ? fopen(p, "w") : NULL;
    if (f) { fputs("the planted library ran\n", f); fclose(f); }
}
"""


def sha(data: bytes) -> bytes:
    return (hashlib.sha256(data).hexdigest() + "\n").encode()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real build in a fresh cache: (library name, its bytes, the cache root it went to)."""
    root = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEWBITS_CACHE", str(root))
        mp.delenv("FEWBITS_NATIVE", raising=False)  # these tests are about the cache: they run anyway
        native.reset()
        lib = native.library()
        st = native.status()
    native.reset()
    assert lib is not None, st
    path = Path(st["path"])
    return path.name, path.read_bytes(), root


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A shared library whose constructor writes the file named by $FEWBITS_TEST_MARKER."""
    d = tmp_path_factory.mktemp("planted")
    (d / "planted.c").write_text(PLANTED_C)
    r = subprocess.run([native._compiler(), "-shared", "-fPIC", "-o", str(d / "planted.so"), str(d / "planted.c")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return (d / "planted.so").read_bytes()


@pytest.fixture
def cache(tmp_path, monkeypatch, built):
    """A fresh cache root with no library loaded; `marker` is the file a planted library's
    constructor would write."""
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("FEWBITS_CACHE", str(root))
    monkeypatch.delenv("FEWBITS_NATIVE", raising=False)
    monkeypatch.setenv("FEWBITS_TEST_MARKER", str(tmp_path / "marker"))
    native.reset()
    yield Cache(root, built[0], tmp_path / "marker")
    native.reset()


class Cache:
    def __init__(self, root: Path, name: str, marker: Path):
        self.root, self.dir, self.marker = root, root / native.LIBRARY_DIR, marker
        self.lib, self.record = self.dir / name, self.dir / (name + native.DIGEST_SUFFIX)

    def install(self, data: bytes, record=None) -> None:
        """Put `data` where the library goes with `record` (None: the SHA-256 of data, as an
        attacker who can write there would write it; False: no record), the directory and the
        files private as a build leaves them."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.lib.write_bytes(data)
        os.chmod(self.lib, 0o700)
        if record is not False:
            self.record.write_bytes(sha(data) if record is None else record)
            os.chmod(self.record, 0o600)


@pytest.fixture
def fake_compiler(monkeypatch, built):
    """native's compile step writes the module's built bytes (with the mode a compiler gives its
    output under the umask); returns the list of the names it wrote."""
    calls = []

    def compile_(cc, dfd, out_name):
        calls.append(out_name)
        fd = os.open(out_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o777, dir_fd=dfd)
        try:
            os.write(fd, built[1])
        finally:
            os.close(fd)

    monkeypatch.setattr(native, "_compile", compile_)
    return calls


def load_recording_warnings():
    """(library(), status(), the fewbits refusal warnings raised), always recording."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        lib = native.library()
    return lib, native.status(), [w for w in got if "not loading the native library" in str(w.message)]


def assert_verified(c: Cache, built) -> None:
    """The cache holds the built library with its record, private."""
    assert c.lib.read_bytes() == built[1] and c.record.read_bytes() == sha(built[1])
    assert stat.S_IMODE(c.dir.stat().st_mode) == 0o700
    assert not c.lib.stat().st_mode & 0o077 and not c.record.stat().st_mode & 0o077
    assert not list(c.dir.glob(".building-*"))


def need_root():
    if os.geteuid() != 0:
        pytest.skip("simulating another owner needs root (os.chown to another uid)")


# --- item 1: build and load only what is the current user's alone --------------------------
def test_a_build_makes_a_private_directory_and_records_the_hash(built):
    name, data, root = built
    d = root / native.LIBRARY_DIR
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == os.geteuid()
    assert (d / name).read_bytes() == data
    assert (d / (name + native.DIGEST_SUFFIX)).read_bytes() == sha(data)
    assert not (d / name).stat().st_mode & 0o077 and not list(d.glob(".building-*"))


def test_a_permissive_umask_still_gives_private_files(cache, fake_compiler, built):
    before = os.umask(0)
    try:
        assert native.library() is not None
    finally:
        os.umask(before)
    assert len(fake_compiler) == 1
    assert_verified(cache, built)


def test_a_shared_cache_root_is_fine_the_library_directory_is_private(cache, fake_compiler, built):
    """The root may hold files shared with others (models): only `native` in it must be private."""
    os.chmod(cache.root, 0o777)
    lib, st, warned = load_recording_warnings()
    assert lib is not None and not warned and st["path"] == str(cache.lib)
    assert_verified(cache, built)


def _plant_and_load(c: Cache, planted: bytes, how: str):
    """Plant the constructor library (with a matching record, as an attacker who can write the
    directory would) and make the cache untrustworthy in the way `how`; returns what loading
    did and the path the refusal must name."""
    c.install(planted)
    refused = c.lib
    if how == "dir group-writable":
        os.chmod(c.dir, 0o770)
        refused = c.dir
    elif how == "dir world-writable":
        os.chmod(c.dir, 0o777)
        refused = c.dir
    elif how == "dir of another owner":
        need_root()
        os.chown(c.dir, FOREIGN_UID, -1)
        refused = c.dir
    elif how == "dir is a symlink":
        elsewhere = c.root / "elsewhere"
        c.dir.rename(elsewhere)
        c.dir.symlink_to(elsewhere)
        refused = c.dir
    elif how == "library of another owner":
        need_root()
        os.chown(c.lib, FOREIGN_UID, -1)
    elif how == "library group-writable":
        os.chmod(c.lib, 0o770)
    elif how == "library world-writable":
        os.chmod(c.lib, 0o666)
    elif how == "library is a symlink":
        elsewhere = c.root / "planted.so"
        c.lib.rename(elsewhere)
        c.lib.symlink_to(elsewhere)
    elif how == "record of another owner":
        need_root()
        os.chown(c.record, FOREIGN_UID, -1)
        refused = c.record
    else:
        raise AssertionError(how)
    return load_recording_warnings(), refused


@pytest.mark.parametrize("how", ["dir group-writable", "dir world-writable", "dir of another owner",
                                 "dir is a symlink", "library of another owner", "library group-writable",
                                 "library world-writable", "library is a symlink", "record of another owner"])
def test_a_planted_library_never_runs(how, cache, planted, fake_compiler):
    (lib, st, warned), refused = _plant_and_load(cache, planted, how)
    assert not cache.marker.exists(), "the planted library's constructor ran"
    assert lib is None and not st["available"] and st["reason"].startswith(f"refused: {refused} ")
    assert len(warned) == 1 and str(refused) in str(warned[0].message)
    assert "torch kernels" in str(warned[0].message)
    reason = ("owned by uid 12345" if "owner" in how else "symbolic link" if "symlink" in how
              else "writable by group or others")
    assert reason in str(warned[0].message)
    assert not fake_compiler, "a refused cache is not built into"
    assert (cache.dir / cache.lib.name).exists(), "a refused file is left for the user to look into"


def test_a_refusal_warns_once_per_path(cache, planted):
    cache.install(planted)
    os.chmod(cache.lib, 0o666)
    first = load_recording_warnings()
    native.reset()
    second = load_recording_warnings()
    assert first[0] is None and second[0] is None
    assert len(first[2]) == 1 and not second[2]
    assert second[1]["reason"] == first[1]["reason"] and str(cache.lib) in first[1]["reason"]
    assert not cache.marker.exists()


# --- item 2: a corrupt cache is rebuilt, never loaded ---------------------------------------
@pytest.mark.parametrize("what", ["planted, record of the real build", "planted, no record", "empty",
                                  "garbage", "malformed record", "truncated"])
def test_a_library_not_matching_its_record_is_rebuilt_never_loaded(what, cache, planted, built, fake_compiler):
    real = built[1]
    if what == "planted, record of the real build":
        cache.install(planted, sha(real))
    elif what == "planted, no record":
        cache.install(planted, False)
    elif what == "empty":
        cache.install(b"", sha(real))
    elif what == "garbage":
        cache.install(b"\x7fELF" + os.urandom(5000), sha(real))
    elif what == "malformed record":
        cache.install(planted, b"not a hash\n")
    else:
        cache.install(real[: len(real) // 2], sha(real))
    lib, st, warned = load_recording_warnings()
    assert not cache.marker.exists(), "a library that does not match its record was loaded"
    assert lib is not None and st["available"] and not warned
    assert len(fake_compiler) == 1 and "rebuilt" in st["reason"], st
    assert_verified(cache, built)


def test_a_matching_library_is_loaded_not_rebuilt(cache, built, fake_compiler):
    cache.install(built[1])
    mtime = cache.lib.stat().st_mtime_ns
    lib, st, warned = load_recording_warnings()
    assert lib is not None and not fake_compiler and not warned and "rebuilt" not in st["reason"]
    assert cache.lib.stat().st_mtime_ns == mtime


TRUNCATION_SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from fewbits.kernels.native import loader as native
    lib_path, good = Path(sys.argv[1]), Path(sys.argv[2]).read_bytes()
    def compile_(cc, dfd, out_name):  # the compiler's output, without spending a compile on it
        fd = os.open(out_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700, dir_fd=dfd)
        os.write(fd, good)
        os.close(fd)
    native._compile = compile_
    for n in map(int, sys.argv[3:]):
        # a new file, not the loaded one truncated in place (which would kill this process)
        lib_path.with_name("cut").write_bytes(good[:n])
        os.replace(lib_path.with_name("cut"), lib_path)  # the record of the good bytes stays
        native.reset()
        assert native.library() is not None, (n, native.status())
        assert "rebuilt" in native.status()["reason"] and lib_path.read_bytes() == good, n
        print("ok", n, flush=True)
""")


def test_a_truncated_library_never_crashes_a_process(cache, built):
    """Truncated at several lengths (each a SIGBUS or a load error before): loading in a fresh
    process rebuilds it and exits cleanly."""
    cache.install(built[1])
    good = cache.root / "good.so"
    good.write_bytes(built[1])
    size = len(built[1])
    lengths = [0, 1, 64, 4096, size // 3, size // 2, size - 1]
    r = subprocess.run([sys.executable, "-c", TRUNCATION_SCRIPT, str(cache.lib), str(good), *map(str, lengths)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == [w for n in lengths for w in ("ok", str(n))]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_leftovers_of_dead_builds_are_removed_a_concurrent_builds_stay(cache, built):
    cache.install(built[1])
    host, dead, hexa = native._host(), _dead_pid(), "0123abcd"
    leftovers = [f".building-{host}-{dead}-{hexa}.so", f".building-{host}-{dead}-{hexa}.sha256"]
    old = f".building-otherhost-{dead}-{hexa}.so"  # another host, but older than any build runs
    live = [f".building-{host}-{os.getpid()}-{hexa}.so",  # a build in a live process
            f".building-otherhost-{dead}-{hexa}1.so",  # another host's build, recent
            ".building-not-a-name-of-ours"]
    for n in leftovers + live + [old]:
        (cache.dir / n).write_bytes(b"partial")
    t = time.time() - native.STALE_BUILD_S - 60
    os.utime(cache.dir / old, (t, t))
    assert native.library() is not None
    assert sorted(p.name for p in cache.dir.glob(".building-*")) == sorted(live)


WRAPPER_CC = """#!/bin/sh
# a compiler that writes its output, then hangs: a build to kill in the middle
out=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  prev="$a"
done
[ -n "$out" ] || { echo "fake cc 1.0"; exit 0; }
echo partial > "$out"
exec sleep 300
"""


def test_a_killed_build_leaves_nothing_after_the_next_load(cache, built, tmp_path):
    cc = tmp_path / "hanging-cc"
    cc.write_text(WRAPPER_CC)
    cc.chmod(0o755)
    env = dict(os.environ, CC=str(cc))
    p = subprocess.Popen([sys.executable, "-c", "from fewbits.kernels import native; native.library()"],
                         env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(cache.dir.glob(".building-*.so")):
            assert p.poll() is None and time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    left = [q.name for q in cache.dir.glob(".building-*")]
    assert left and all(re.fullmatch(native._TEMP_NAME, n) for n in left)
    cache.install(built[1])
    assert native.library() is not None
    assert not list(cache.dir.glob(".building-*"))


def test_loading_works_without_flock_and_keeps_a_live_builds_files(cache, built, monkeypatch):
    """Without flock (some network file systems) loading still works: publishing is atomic."""
    def no_flock(fd, op):
        raise OSError(38, "Function not implemented")

    cache.install(built[1])
    monkeypatch.setattr(native.fcntl, "flock", no_flock)
    live = cache.dir / f".building-{native._host()}-{os.getpid()}-00.so"
    live.write_bytes(b"partial")
    assert native.library() is not None and live.exists()


CONCURRENT_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from fewbits.kernels.native import loader as native
    good, compiled = Path(sys.argv[1]).read_bytes(), []
    def compile_(cc, dfd, out_name):  # a slow compiler: the other process comes while it runs
        compiled.append(out_name)
        fd = os.open(out_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700, dir_fd=dfd)
        os.write(fd, good[:1000])
        time.sleep(1.5)
        os.write(fd, good[1000:])
        os.close(fd)
    native._compile = compile_
    assert native.library() is not None, native.status()
    print(len(compiled))
""")


def test_concurrent_first_loads_build_once_and_agree(cache, built):
    """Two processes loading an empty cache at once: one builds (under the directory's lock),
    the other waits and loads that build; neither removes the other's files."""
    good = cache.root.parent / "good.so"
    good.write_bytes(built[1])
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT_SCRIPT, str(good)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [q.communicate(timeout=300) for q in procs]
    assert [q.returncode for q in procs] == [0, 0], outs
    assert sorted(int(o[0]) for o in outs) == [0, 1], outs
    assert_verified(cache, built)
    assert sorted(p.name for p in cache.dir.iterdir()) == sorted([".lock", cache.lib.name, cache.record.name])


# --- found by a hostile review of the cache (issue 12, items 1 and 2) -----------------------
def _plant_other_file(c: Cache, how: str):
    """Make the library (installed, good) or `.lock` something that is not the current user's
    regular file; returns the path the refusal must name and the reason it must give."""
    lock = c.dir / ".lock"
    if how == "lock is a symlink":
        lock.symlink_to(c.root / "elsewhere")
        return lock, "symbolic link"
    if how == "lock is a directory":
        lock.mkdir()
        return lock, "not a regular file"
    if how == "lock is a fifo":
        os.mkfifo(lock, 0o600)
        return lock, "not a regular file"
    if how == "lock of another owner":
        need_root()
        lock.write_bytes(b"")
        os.chmod(lock, 0o666)
        os.chown(lock, FOREIGN_UID, -1)
        return lock, "owned by uid 12345"
    if how == "library is a socket":
        import socket
        c.lib.unlink()
        here = os.getcwd()
        os.chdir(c.dir)  # bound by its relative name: a socket's path has a length limit
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(c.lib.name)
        finally:
            os.chdir(here)
        return c.lib, "not a regular file"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["lock is a symlink", "lock is a directory", "lock is a fifo",
                                 "lock of another owner", "library is a socket"])
def test_a_lock_or_library_not_ours_is_refused_with_one_warning(how, cache, built, fake_compiler):
    """`.lock` was opened unchecked: a symbolic link or directory gave a silent 'build failed'
    without the path, and a lock file of another owner (left from a time the directory was not
    private) let that owner hold every load for LOCK_WAIT_S; a socket in the library's place gave
    a silent 'build failed' and was never looked at again. Now each is a refusal like the others:
    one warning naming the path and the reason, nothing built, nothing removed."""
    cache.install(built[1])
    refused, reason = _plant_other_file(cache, how)
    before = sorted(p.name for p in cache.dir.iterdir())
    lib, st, warned = load_recording_warnings()
    assert lib is None and st["reason"].startswith(f"refused: {refused} "), st
    assert len(warned) == 1 and f"{refused} " in str(warned[0].message) and reason in str(warned[0].message)
    after = sorted(p.name for p in cache.dir.iterdir())
    assert not fake_compiler and set(before) <= set(after) and set(after) - set(before) <= {".lock"}


def test_a_lock_file_is_created_private_and_reused(cache, built):
    cache.install(built[1])
    assert native.library() is not None
    st = (cache.dir / ".lock").stat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    native.reset()
    assert native.library() is not None and (cache.dir / ".lock").stat().st_ino == st.st_ino


def test_a_building_name_with_an_impossible_pid_is_swept_not_raised(cache, built):
    """A .building-* name of this host with a pid past any C long made os.kill raise
    OverflowError out of library(): every kernel call raised, for good."""
    cache.install(built[1])
    huge = cache.dir / f".building-{native._host()}-{'9' * 30}-ab.so"
    huge.write_bytes(b"partial")
    assert native.library() is not None, native.status()
    assert not huge.exists()


def test_the_sweep_leaves_files_of_another_owner(cache, built):
    """The sweep removed a dead build's name whoever owned the file; fewbits made none of
    another owner's files, and a file of another owner is for the user to look into."""
    need_root()
    cache.install(built[1])
    host, dead = native._host(), _dead_pid()
    foreign, own = cache.dir / f".building-{host}-{dead}-aa.so", cache.dir / f".building-{host}-{dead}-bb.so"
    for p in (foreign, own):
        p.write_bytes(b"partial")
    os.chown(foreign, FOREIGN_UID, -1)
    assert native.library() is not None
    assert foreign.exists() and not own.exists()


def test_missing_cache_directories_are_created_private_under_any_umask(cache, fake_compiler, monkeypatch):
    """Under umask 000 the missing cache root and its parents (~/.cache, ~/.cache/fewbits)
    were created 0777: writable by everybody."""
    top = cache.root / "a"
    monkeypatch.setenv("FEWBITS_CACHE", str(top / "b"))
    before = os.umask(0)
    try:
        assert native.library() is not None, native.status()
    finally:
        os.umask(before)
    for d in (top, top / "b", top / "b" / native.LIBRARY_DIR):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(cache.root.stat().st_mode) != 0o700, "an existing directory keeps its mode"


def test_a_compiler_printing_bytes_that_are_not_utf8_is_a_failed_build(cache, tmp_path, monkeypatch):
    """`cc --version` (or its errors) in bytes that are not UTF-8 raised UnicodeDecodeError out
    of library() on every call."""
    cc = tmp_path / "latin1-cc"
    cc.write_bytes(b"#!/bin/sh\n[ \"$1\" = --version ] && { printf 'cc \\351 1.0\\n'; exit 0; }\n"
                   b"printf 'erreur \\351\\n' >&2; exit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert native.library() is None
    assert native.status()["reason"].startswith("build failed: ") and "erreur" in native.status()["reason"]


def test_an_oversized_record_is_named_as_the_record(cache, built, fake_compiler):
    cache.install(built[1], b"0" * 5000)
    lib, st, warned = load_recording_warnings()
    assert lib is not None and not warned and len(fake_compiler) == 1
    assert "its SHA-256 record is larger than 100 bytes" in st["reason"], st
    assert_verified(cache, built)


def test_the_module_imports_and_falls_back_without_fcntl(tmp_path):
    """native.py imported fcntl unconditionally: where there is none (Windows), importing
    fewbits failed altogether instead of keeping the torch kernels."""
    script = ("import sys; sys.modules['fcntl'] = None\n"
              "from fewbits.kernels import native\n"
              "assert native.library() is None\n"
              "print(native.status()['reason'])\n")
    env = dict(os.environ, FEWBITS_CACHE=str(tmp_path))
    env.pop("FEWBITS_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fcntl" in r.stdout and not (tmp_path / native.LIBRARY_DIR).exists()


POISON_SCRIPT = textwrap.dedent("""
    import ctypes, os, sys
    from fewbits.kernels import native
    # another component loads a library as /proc/self/fd/N for the next N's, then closes them
    fds = [os.open(sys.argv[1], os.O_RDONLY) for _ in range(64)]
    for fd in fds:
        ctypes.CDLL(f"/proc/self/fd/{fd}")
    for fd in fds:
        os.close(fd)
    lib = native.library()
    assert lib is not None, native.status()
    assert lib.fb_round32_vectorized() in (0, 1)
    print("ok")
""")


def test_a_proc_fd_name_another_library_was_loaded_under_is_not_ours(cache, built, planted, tmp_path):
    """The loader matches libraries by name first: once another component had loaded a library
    as /proc/self/fd/N and closed N, dlopen of our verified file as /proc/self/fd/N returned
    that other library (seen: 'undefined symbol: fb_row_absmax', or its code called as ours)."""
    cache.install(built[1])
    other = tmp_path / "other.so"
    other.write_bytes(planted)  # its constructor writes nothing: no marker in this environment
    env = {k: v for k, v in os.environ.items() if k not in ("FEWBITS_TEST_MARKER", "FEWBITS_NATIVE")}
    r = subprocess.run([sys.executable, "-c", POISON_SCRIPT, str(other)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], (r.stdout, r.stderr[-2000:])


def test_a_relative_compiler_path_builds(cache, built, tmp_path, monkeypatch):
    """CC=./cc (or a relative PATH entry) was run relative to the cache directory, where the
    compile runs: 'No such file or directory', and no library."""
    good = tmp_path / "good.so"
    good.write_bytes(built[1])
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "cc").write_text(WRAPPER_CC.replace('echo partial > "$out"\nexec sleep 300', f'cp {good} "$out"'))
    (bindir / "cc").chmod(0o755)
    monkeypatch.chdir(bindir)
    monkeypatch.setenv("CC", "./cc")
    lib, st, warned = load_recording_warnings()
    assert lib is not None and not warned, st
    # the library's name hashes this compiler's --version: another name than the real build's
    assert Path(st["path"]).parent == cache.dir and Path(st["path"]).read_bytes() == built[1]


KILLED_OPENMP_CC = """#!/bin/sh
# a compiler whose OpenMP compile dies ({how}); without OpenMP it gives the good bytes
out=""
prev=""
omp=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  [ "$a" = "-fopenmp" ] && omp=1
  prev="$a"
done
[ -n "$out" ] || {{ echo "fake cc 1.0"; exit 0; }}
[ -n "$omp" ] && {{ {action}; }}
cp {good} "$out"
"""


@pytest.mark.parametrize("how, action", [("killed", "kill -KILL $$"),
                                         ("internal compiler error", "echo 'cc1: Killed' >&2; exit 4")],
                         ids=["killed", "internal compiler error"])
def test_a_killed_compile_is_a_failed_build_not_a_library_without_openmp(how, action, cache, built, tmp_path,
                                                                         monkeypatch):
    """A compile killed (out of memory, a signal) was taken for a compiler without OpenMP: the
    build was retried without it and cached for good under the library's name."""
    good = tmp_path / "good.so"
    good.write_bytes(built[1])
    cc = tmp_path / "cc"
    cc.write_text(KILLED_OPENMP_CC.format(how=how, action=action, good=good))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert native.library() is None
    assert native.status()["reason"].startswith("build failed: "), native.status()
    assert sorted(p.name for p in cache.dir.iterdir()) == [".lock"], "nothing is cached, nothing left"


def test_a_compiler_without_openmp_still_builds(cache, built, tmp_path, monkeypatch):
    good = tmp_path / "good.so"
    good.write_bytes(built[1])
    cc = tmp_path / "cc"
    cc.write_text(KILLED_OPENMP_CC.format(how="no OpenMP", good=good,
                                          action="echo 'unrecognized option -fopenmp' >&2; exit 1"))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert native.library() is not None, native.status()
    assert Path(native.status()["path"]).read_bytes() == built[1]
