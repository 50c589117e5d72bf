"""Writes that survive a crash or a power cut at any instant: whole or not at all, and on the disk.

A rename alone is atomic for readers but not durable: after a power cut the new name may point at
data that never reached the disk. So every write here is write, fsync, rename, fsync the folder.

A state that spans several files (an adapter's weights, its config, the version it is served as) is
a *generation*: a folder `<name>@<n>` (n counts up) filled and synced under a temporary name, renamed
whole, then made current by one atomic flip of the symlink `<name>` (a rename). A crash leaves either the old generation current or the
new one, never a mix; the previous generation is kept, so a reader that finds the current one
torn (a disk that lied) can fall back to it (`generations`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Make the entries of a folder (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes | str, sync_dir: bool = True) -> Path:
    """Replace `path` with `data`: a temp file beside it, fsynced, renamed over it, the folder fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)
    return path


def replace_synced(tmp: str | Path, path: str | Path) -> None:
    """Rename a file someone else wrote (`tmp`) over `path`, durably: the file, then the folder."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(Path(path).parent)


def sync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fsync_file(p)
    for d in sorted({p.parent for p in folder.rglob("*")} | {folder}, key=lambda p: -len(p.parts)):
        fsync_dir(d)


def publish_generation(parent: str | Path, name: str, fill: Callable[[Path], None], keep: int = 2) -> Path:
    """Write a new generation of `parent/name` with `fill(folder)`, make it current in one rename and keep the
    `keep` newest generations (the current one and its fallback). A plain folder `name` from before
    generations existed is moved aside as the oldest generation first."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    link = parent / name
    if link.is_dir() and not link.is_symlink():  # the layout before generations: keep it as a fallback
        os.replace(link, parent / f"{name}@0")
    for leftover in parent.glob(f".{name}@*.tmp"):  # a fill a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    # a counter, not the clock: a clock stepped back (a board without an RTC) must not make a new one look old
    gen = parent / f"{name}@{max((_stamp(p) for p in parent.glob(f'{name}@*')), default=0) + 1}"
    tmp_gen = parent / f".{gen.name}.tmp"  # filled under a name readers never take, renamed once whole
    tmp_gen.mkdir()
    try:
        fill(tmp_gen)
        sync_tree(tmp_gen)
        os.replace(tmp_gen, gen)
    except BaseException:
        shutil.rmtree(tmp_gen, ignore_errors=True)
        raise
    tmp = parent / f".{name}.link.tmp"
    tmp.unlink(missing_ok=True)
    os.symlink(gen.name, tmp)  # relative: the state folder may be moved or mounted elsewhere
    os.replace(tmp, link)  # the flip: one atomic rename
    fsync_dir(parent)
    for old in generations(parent, name)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return gen


def generations(parent: str | Path, name: str) -> list[Path]:
    """The generations of `parent/name` a reader should try, in order: the current one, then the others newest
    first (a plain folder `name` of the old layout counts as current)."""
    parent = Path(parent)
    link = parent / name
    current = None
    if link.is_symlink():
        target = parent / os.readlink(link)
        current = target if target.is_dir() else None
    elif link.is_dir():
        current = link
    others = sorted((p for p in parent.glob(f"{name}@*") if p.is_dir() and p != current), key=_stamp, reverse=True)
    return ([current] if current is not None else []) + others


def _stamp(p: Path) -> int:
    try:
        return int(p.name.rsplit("@", 1)[1])
    except (IndexError, ValueError):
        return -1
