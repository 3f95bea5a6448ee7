"""Writing without losing anything: atomic files, atomic directory replacement, and a write check that runs
BEFORE the expensive work.

The rule everywhere: a result appears under its final name only when it is complete; until then the previous
version (if any) stays intact. An interrupt at any moment (Ctrl-C, ``kill -9``, a full disk) leaves either the
old output or the new one, never a mixture, and the next run cleans up what a killed one left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
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
    """Clean up after killed replacements of ``dst``: partial new outputs are deleted; an old output that was
    moved aside but never replaced (killed between the two renames) is put back."""
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
            shutil.rmtree(path, ignore_errors=True)


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


def replace_directory(tmp: str | Path, dst: str | Path) -> None:
    """Put the complete directory ``tmp`` in place of ``dst``: the old ``dst`` is renamed aside, ``tmp`` renamed
    in, and only then the old one deleted. A kill between the renames is repaired by ``recover_directory``."""
    tmp, dst = Path(tmp), Path(dst).absolute()
    with _sigint_deferred():
        aside = None
        if dst.exists() or dst.is_symlink():
            aside = dst.parent / f".{dst.name}{_OLD_TAG}{os.getpid()}-{int(time.time() * 1000)}"
            os.replace(dst, aside)
        try:
            os.replace(tmp, dst)
        except OSError:
            if aside is not None:  # the new output could not go in: the old one goes back
                os.replace(aside, dst)
            raise
        _fsync_dir(dst.parent)
    if aside is not None:
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink(missing_ok=True)
