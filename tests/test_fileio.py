"""``dflash_jax.fileio.replace_directory`` / ``recover_directory``: the final name holds the old or the new
output at every instant, and what a ``kill -9`` leaves behind is repaired by the next run.

The kill tests run a child process that SIGKILLs itself at a chosen instant (a monkeypatched hook), so every
instant is hit deterministically instead of by timing luck."""

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_jax import fileio
from dflash_jax.fileio import new_directory, recover_directory, replace_directory

ROOT = Path(__file__).resolve().parents[1]
N_FILES = 40  # enough that a half-deleted old output is clearly incomplete

# The child: writes the "old" output, then replaces it by a "new" one and SIGKILLs itself at POINT. Exits 0
# only if the kill never came (a wrong hook name would otherwise pass silently).
CHILD = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from dflash_jax import fileio

    dst, point, nested, n = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "nested", int(sys.argv[4])

    def write(out, version):
        (out / "sub").mkdir(parents=True)
        for i in range(n):
            (out / "sub" / f"f{i}").write_text(f"{version}-{i}")
        (out / "VERSION").write_text(version)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    tmp = fileio.new_directory(dst)
    write(tmp, "old")
    assert fileio.replace_directory(tmp, dst) == "created"

    real_exchange, real_replace, real_remove = fileio._exchange, os.replace, fileio._remove
    if point.startswith("fallback"):
        fileio._exchange = lambda a, b: False
    if point == "before_exchange":
        fileio._exchange = lambda a, b: die()
    if point == "after_exchange":
        fileio._exchange = lambda a, b: real_exchange(a, b) and die()
    if point in ("mid_delete", "fallback_mid_delete"):
        def remove(path):  # half the old output deleted, then killed
            for i in range(n // 2):
                (path / "sub" / f"f{i}").unlink()
            die()
        fileio._remove = remove
    if point == "fallback_between_renames":
        def replace(a, b):  # the old output moved aside, the new one not yet in
            real_replace(a, b)
            if Path(b).name.startswith(f".{dst.name}.replaced-"):
                die()
        os.replace = replace

    tmp = fileio.new_directory(dst)
    out = tmp / "done" if nested else tmp  # nested: the shape infer.convert uses (tmp/done inside .partial-)
    write(out, "new")
    fileio.replace_directory(out, dst)
""")


def version(out: Path) -> str:
    """"old" or "new" when ``out`` is a complete output of that version, else an AssertionError."""
    v = (out / "VERSION").read_text()
    files = sorted((out / "sub").iterdir())
    assert len(files) == N_FILES, (out, len(files))
    assert all(f.read_text() == f"{v}-{f.name[1:]}" for f in files), out
    return v


def run_child(dst: Path, point: str, nested: bool = False) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(dst), point, "nested" if nested else "direct",
                           str(N_FILES)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode in (0, -9), proc.stderr
    return proc.returncode


def names(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux only")
def test_linux_uses_the_one_step_exchange(tmp_path):
    dst = tmp_path / "out"
    assert fileio._load_renameat2() is not None, "glibc >= 2.28 has renameat2"
    for v in ("old", "new", "newer"):
        tmp = new_directory(dst)
        (tmp / "VERSION").write_text(v)
        how = replace_directory(tmp, dst)
        assert how == ("created" if v == "old" else "exchanged")
        assert (dst / "VERSION").read_text() == v and names(tmp_path) == ["out"]


# (kill point, path the child takes, what the final name holds right after the kill, after recover_directory)
KILLS = [
    ("before_exchange", False, "old", "old"),  # the complete new output is only a .partial- leftover: deleted
    ("after_exchange", False, "new", "new"),  # tmp's name holds the OLD output: deleted, never put back
    ("after_exchange", True, "new", "new"),
    ("mid_delete", False, "new", "new"),  # a half-deleted .replaced- leftover next to the new output
    ("fallback_between_renames", False, None, "old"),  # the fallback's known gap: the old output goes back
    ("fallback_mid_delete", False, "new", "new"),
]


@pytest.mark.parametrize("point,nested,right_after,recovered", KILLS)
def test_kill_at_every_instant_is_repaired(tmp_path, point, nested, right_after, recovered):
    if not point.startswith("fallback") and fileio._load_renameat2() is None:
        pytest.skip("no renameat2 here")
    dst = tmp_path / "out"
    assert run_child(dst, point, nested) == -9, "the child must die at the hook"
    assert len(names(tmp_path)) > 1, "the kill must leave something for recover_directory"
    if right_after is None:
        assert not dst.exists()
    else:
        assert version(dst) == right_after
    recover_directory(dst)
    assert version(dst) == recovered
    assert names(tmp_path) == ["out"], "no leftover may survive recovery"


def test_no_kill_needs_no_recovery(tmp_path):
    """Control for the kill tests: an unknown hook name never fires, and the replacement completes."""
    dst = tmp_path / "out"
    assert run_child(dst, "none") == 0
    assert version(dst) == "new" and names(tmp_path) == ["out"]


WATCHED = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from dflash_jax import fileio

    dst, seconds, fallback = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "fallback"
    if fallback:  # the control: the two-rename path, its gap widened so that a working watcher must see it
        fileio._exchange = lambda a, b: False
        real_replace = os.replace
        def replace(a, b):
            real_replace(a, b)
            if Path(b).name.startswith(f".{dst.name}.replaced-"):
                time.sleep(0.002)
        os.replace = replace

    def one():
        tmp = fileio.new_directory(dst)
        (tmp / "MARKER").write_text("x")
        return fileio.replace_directory(tmp, dst)

    assert one() == "created"
    print("ready", flush=True)
    ways, end = set(), time.monotonic() + seconds
    while time.monotonic() < end:
        ways.add(one())
    print(",".join(sorted(ways)), flush=True)
""")


def watch(dst: Path, seconds: float, mode: str) -> tuple[int, int, str]:
    """Replace ``dst`` for ``seconds`` in a child while polling it here; returns (checks, misses, paths)."""
    proc = subprocess.Popen([sys.executable, "-c", WATCHED, str(dst), str(seconds), mode], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    marker, checks, misses = str(dst / "MARKER"), 0, 0
    while proc.poll() is None:
        for _ in range(500):  # poll() between batches: the checks themselves must come as fast as possible
            checks += 1
            if not (os.path.isdir(dst) and os.path.exists(marker)):
                misses += 1
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return checks, misses, out.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux only")
def test_a_watcher_never_sees_the_output_missing(tmp_path):
    checks, misses, ways = watch(tmp_path / "out", 1.5, "exchange")
    assert ways == "exchanged" and checks > 10_000
    assert misses == 0, f"the output was missing at {misses} of {checks} checks"
    assert names(tmp_path) == ["out"]


def test_the_watcher_does_see_the_fallback_gap(tmp_path):
    """Control for the watcher: with the two-rename path (gap widened to 2 ms) it must notice the output gone,
    so a zero above means no gap, not a blind watcher."""
    checks, misses, ways = watch(tmp_path / "out", 0.3, "fallback")
    assert ways == "renamed" and misses > 0


def fill(dst: Path, text: str) -> Path:
    tmp = new_directory(dst)
    (tmp / "VERSION").write_text(text)
    return tmp


def test_fallback_without_renameat2(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "_load_renameat2", lambda: None)  # non-Linux, or glibc < 2.28
    dst = tmp_path / "out"
    assert replace_directory(fill(dst, "old"), dst) == "created"
    assert replace_directory(fill(dst, "new"), dst) == "renamed"
    assert (dst / "VERSION").read_text() == "new" and names(tmp_path) == ["out"]


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP])
def test_fallback_when_the_file_system_refuses_the_exchange(tmp_path, monkeypatch, code):
    import ctypes

    def refused(*args):
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(fileio, "_load_renameat2", lambda: refused)
    dst = tmp_path / "out"
    replace_directory(fill(dst, "old"), dst)
    assert replace_directory(fill(dst, "new"), dst) == "renamed"
    assert (dst / "VERSION").read_text() == "new" and names(tmp_path) == ["out"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux only")
def test_a_real_failure_raises_and_keeps_the_old_output(tmp_path):
    dst = tmp_path / "out"
    replace_directory(fill(dst, "old"), dst)
    with pytest.raises(FileNotFoundError):
        replace_directory(tmp_path / "missing", dst)
    assert (dst / "VERSION").read_text() == "old" and names(tmp_path) == ["out"]


def test_files_and_symlinks_are_replaced_too(tmp_path):
    dst = tmp_path / "out"
    dst.write_text("a file")
    replace_directory(fill(dst, "new"), dst)
    assert (dst / "VERSION").read_text() == "new"
    (tmp_path / "target").mkdir()
    dst_link = tmp_path / "link"
    dst_link.symlink_to(tmp_path / "target")
    replace_directory(fill(dst_link, "new"), dst_link)
    assert not dst_link.is_symlink() and (dst_link / "VERSION").read_text() == "new"
    assert names(tmp_path) == ["link", "out", "target"], "a replaced symlink's target is not deleted"


def test_leftovers_of_a_live_process_are_left_alone(tmp_path):
    dst = tmp_path / "out"
    partial = new_directory(dst)  # this process's pid: a replacement still under way
    recover_directory(dst)
    assert partial.is_dir()
