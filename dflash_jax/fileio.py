"""Writing without losing anything: atomic files, atomic directory replacement, and a write check that runs
BEFORE the expensive work.

The rule everywhere: a result appears under its final name only when it is complete; until then the previous
version (if any) stays intact. An interrupt at any moment (Ctrl-C, ``kill -9``, a full disk) leaves either the
old output or the new one, never a mixture, and the next run cleans up what a killed one left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

from dflash_jax.errors import UserError

_TMP_TAG = ".partial-"  # <parent>/.<name>.partial-<pid>-<ms>: a new output being written
_OLD_TAG = ".replaced-"  # <parent>/.<name>.replaced-<pid>-<ms>: an old output on its way out


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # makes a rename durable; not possible on every platform
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[IO[bytes]]:
    """Write ``path`` through ``path.tmp``: flushed, fsynced and renamed only when the block succeeds, so an
    interrupted write never leaves a valid-looking partial file under the final name."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text.encode("utf-8"))


def write_json_atomic(path: str | Path, value: Any) -> None:
    write_text_atomic(path, json.dumps(value, indent=1, ensure_ascii=False) + "\n")


def ensure_writable_dir(directory: str | Path, what: str) -> Path:
    """Create ``directory`` if needed and prove it takes a file, before any expensive work; the error names
    ``what`` (the argument) and the path."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{what} {directory}: exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{what} {directory}: cannot write there ({e.strerror or e})") from None
    return directory


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(dst: Path, tag: str) -> list[tuple[Path, int]]:
    out = []
    for p in dst.parent.glob(f".{dst.name}{tag}*"):
        try:
            pid = int(p.name[len(f".{dst.name}{tag}"):].split("-")[0])
        except ValueError:
            continue
        out.append((p, pid))
    return out


def recover_directory(dst: str | Path) -> None:
    """Clean up after killed replacements of ``dst`` (by processes no longer alive), whichever path
    ``replace_directory`` took. The rules, and the kill instants they cover:

    * a ``.partial-`` folder is always deleted, never put in place: killed while writing it, it is incomplete;
      killed before the swap, ``dst`` still holds the old output; killed right after an exchange, it holds
      the OLD output (or, in ``infer convert``, contains it) and ``dst`` already holds the new one;
    * a ``.replaced-`` folder is put back only when ``dst`` is missing, which happens only to the two-rename
      fallback killed between its renames (then it is the complete old output); otherwise ``dst`` holds the
      new output and the old one, perhaps half deleted, is deleted.
    """
    dst = Path(dst)
    if not dst.parent.is_dir():
        return
    for path, pid in _leftovers(dst, _TMP_TAG):
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
    for path, pid in _leftovers(dst, _OLD_TAG):
        if _pid_alive(pid):
            continue
        if not dst.exists() and not dst.is_symlink():
            os.replace(path, dst)
        else:
            _remove(path)


def new_directory(dst: str | Path) -> Path:
    """A fresh temporary directory next to ``dst`` (same file system, so the final rename is atomic)."""
    dst = Path(dst).absolute()
    tmp = dst.parent / f".{dst.name}{_TMP_TAG}{os.getpid()}-{int(time.time() * 1000)}"
    tmp.mkdir(parents=True)
    return tmp


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C across a few renames (re-raised after them), so that it cannot land between them."""
    pending: list[Any] = []
    try:
        old = signal.signal(signal.SIGINT, lambda *a: pending.append(a))
    except ValueError:  # not the main thread: nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            raise KeyboardInterrupt


_AT_FDCWD = -100  # Linux: paths relative to the working directory
_RENAME_EXCHANGE = 2  # linux/fs.h
# renameat2 failures that mean "no exchange here", not "this rename is impossible": no syscall (kernel < 3.15,
# ENOSYS), a file system without the flag (EINVAL / EOPNOTSUPP), a seccomp filter that denies the syscall
# (EPERM in older container runtimes). The fallback then either succeeds or raises the real error itself.
_NO_EXCHANGE = frozenset({errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM})


@functools.cache
def _load_renameat2() -> Any:
    """libc's ``renameat2`` (glibc >= 2.28), or None where there is none (non-Linux, older or other libcs)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step: True when done, False where this system or file
    system cannot (the caller falls back); any other failure raises with nothing changed."""
    fn = _load_renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace_directory(tmp: str | Path, dst: str | Path) -> str:
    """Put the complete directory ``tmp`` in place of ``dst``, deleting the old ``dst`` only afterwards; returns
    the path taken: ``"created"`` (no old ``dst``), ``"exchanged"`` or ``"renamed"``.

    On Linux the two are swapped by one ``renameat2(RENAME_EXCHANGE)``, so the name ``dst`` holds the old or
    the new output at every instant, even under ``kill -9``. Where that call is missing or refused (non-Linux,
    glibc < 2.28, a file system without it) the old ``dst`` is renamed aside and ``tmp`` renamed in: a kill
    between those two renames leaves ``dst`` missing until ``recover_directory`` puts the old one back.

    ``tmp`` must come from ``new_directory(dst)`` or lie inside such a folder: right after an exchange the old
    output sits under ``tmp``'s name, and only that name tells ``recover_directory`` to delete it."""
    tmp, dst = Path(tmp).absolute(), Path(dst).absolute()
    with _sigint_deferred():
        if not dst.exists() and not dst.is_symlink():  # nothing to exchange with
            os.replace(tmp, dst)
            _fsync_dir(dst.parent)
            return "created"
        aside = dst.parent / f".{dst.name}{_OLD_TAG}{os.getpid()}-{int(time.time() * 1000)}"
        if _exchange(tmp, dst):
            how = "exchanged"
            # tmp's name now holds the old output. Renamed to the "on its way out" name before the slow delete,
            # so that a kill during the delete leaves a recognisable leftover whatever tmp was called.
            try:
                os.replace(tmp, aside)
            except OSError:  # the replacement itself is done: delete the old output where it is
                aside = tmp
        else:
            how = "renamed"
            os.replace(dst, aside)
            try:
                os.replace(tmp, dst)
            except OSError:  # the new output could not go in: the old one goes back
                os.replace(aside, dst)
                raise
        _fsync_dir(dst.parent)
    _remove(aside)
    return how
