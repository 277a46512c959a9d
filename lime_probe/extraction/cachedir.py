"""The activation cache folder as a whole: list its entries with their sizes, clear them, report growth.

``lime-probe cache`` is `cache_report`; the analysis commands wrap their work in `report_growth`, and
each analysis in `cache_use`, so the entries it writes or reuses record what they were for. This module
needs no torch, so listing or clearing the cache starts at once. The entries are the folders
`lime_probe.extraction.cache.ShardCache` writes (``<prefix>-<16 hex digits>/`` with a manifest); nothing else under
the cache root is listed or removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

MANIFEST = "manifest.json"

_ENTRY_NAME = re.compile(r"^[\w.-]+-[0-9a-f]{16}$")  # "<prefix>-<key hash>", as ShardCache names its folders

# What the cache entries written or reused in a block are for (an analysis, "blimp"); set by `cache_use`,
# recorded by `lime_probe.extraction.cache.ShardCache` in the entry's manifest, shown by `cache_report`.
CACHE_USE: ContextVar[str] = ContextVar("lime_probe_cache_use", default="")


@contextlib.contextmanager
def cache_use(label: str) -> Iterator[None]:
    """Inside the block, cache entries written or reused are recorded as used by ``label`` (nested labels
    are joined with " / ")."""
    outer = CACHE_USE.get()
    token = CACHE_USE.set(f"{outer} / {label}" if outer else label)
    try:
        yield
    finally:
        CACHE_USE.reset(token)


@dataclass(frozen=True)
class CacheEntry:
    """One cached extraction under a cache root: its folder, what it holds and how big it is."""

    directory: Path
    checkpoint: str  # the checkpoint's path or hub id, or "in-memory model <hash>"
    sites: str  # e.g. "hidden, values"
    uses: tuple[str, ...]  # what wrote or reused it (`cache_use`), e.g. ("blimp",); () for older entries
    about: str  # the data, e.g. the start of its first text
    n_sequences: int
    complete: bool
    size: int  # bytes
    modified: float  # newest mtime of its files (seconds since the epoch): when it was last written

    def age_days(self, now: float | None = None) -> float:
        return ((time.time() if now is None else now) - self.modified) / 86400


def _folder_size(folder: Path) -> tuple[int, float]:
    """(bytes, newest mtime) of the files under `folder`."""
    size, newest = 0, folder.stat().st_mtime
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # a file removed while we look
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                newest = max(newest, st.st_mtime)
    return size, newest


def _describe_key(key: dict[str, Any]) -> tuple[str, str]:
    ident = key.get("checkpoint", {})
    if "parameters" in ident:
        checkpoint = f"in-memory model {ident['parameters'][:12]}"
    else:
        checkpoint = str(ident.get("path") or ident.get("id") or "?")
    sites = ", ".join(key.get("settings", {}).get("sites", {}) or ())
    return checkpoint, sites or "?"


def cache_entries(root: str | os.PathLike) -> list[CacheEntry]:
    """Every cached extraction under `root` (folders named as `ShardCache` names them), oldest first.

    Nothing else under `root` is listed (or ever removed by `clear_cache`), so pointing it at the
    wrong folder is harmless. A missing `root` has no entries.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    entries = []
    for folder in root.iterdir():
        if not (folder.is_dir() and not folder.is_symlink() and _ENTRY_NAME.match(folder.name)):
            continue
        try:
            stored = json.loads((folder / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            stored = {}  # interrupted before its first shard, or unreadable: still counts, still removable
        checkpoint, sites = _describe_key(stored.get("key", {}))
        size, modified = _folder_size(folder)
        n_sequences = sum(int(s.get("n_sequences", 0)) for s in stored.get("shards", []))
        uses, about = tuple(stored.get("uses", ())), str(stored.get("about", ""))
        entries.append(
            CacheEntry(
                folder,
                checkpoint,
                sites,
                uses,
                about,
                n_sequences,
                bool(stored.get("complete")),
                size,
                modified,
            )
        )
    return sorted(entries, key=lambda e: (e.modified, e.directory.name))


def cache_size(root: str | os.PathLike | None) -> int:
    """Bytes held by the cache entries under `root` (0 for None or a missing folder)."""
    return sum(e.size for e in cache_entries(root)) if root is not None else 0


def selected_entries(
    root: str | os.PathLike, older_than_days: float | None = None, checkpoint: str | None = None
) -> list[CacheEntry]:
    """The entries under `root` last written more than `older_than_days` days ago (all if None) and of
    `checkpoint` (a path, matched as given or resolved, or a hub id; all if None). ValueError for a
    negative age."""
    if older_than_days is not None and older_than_days < 0:
        raise ValueError(f"--older-than must be a number of days >= 0, got {older_than_days}")
    now = time.time()
    names = None if checkpoint is None else {checkpoint, str(Path(checkpoint).expanduser().resolve())}
    return [
        e
        for e in cache_entries(root)
        if (names is None or e.checkpoint in names)
        and (older_than_days is None or e.age_days(now) > older_than_days)
    ]


def clear_cache(
    root: str | os.PathLike, older_than_days: float | None = None, checkpoint: str | None = None
) -> list[CacheEntry]:
    """Remove the cache entries under `root` that `selected_entries` selects; return them. Files that are
    not cache entries are left alone."""
    removed = selected_entries(root, older_than_days, checkpoint)
    for entry in removed:
        shutil.rmtree(entry.directory)
    return removed


NO_TERMINAL = "--clear asks before removing and stdin is not a terminal: add --yes to clear anyway"


def confirm_on_terminal(question: str) -> bool:
    """Ask ``question`` on the terminal, yes only for "y"/"yes"; ValueError when stdin is not a terminal
    (a script, a pipe): nobody could answer, so nothing is removed without ``--yes``."""
    if not sys.stdin.isatty():
        raise ValueError(NO_TERMINAL)
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def format_size(n_bytes: float) -> str:
    """Bytes in decimal units: "0 B", "512 B", "1.5 kB", "601.2 MB"."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n_bytes) < 1000 or unit == "GB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    raise AssertionError("unreachable")


def _entries_text(n: int) -> str:
    return f"{n} cache entr{'y' if n == 1 else 'ies'}"


def cache_report(
    root: str | os.PathLike,
    *,
    clear: bool = False,
    older_than_days: float | None = None,
    checkpoint: str | None = None,
    yes: bool = False,
) -> str:
    """What ``lime-probe cache`` prints: the entries grouped by checkpoint, one line each (size, age,
    sequences, what used it, sites, the start of its data) and the total; or, with `clear`, what was
    removed. `older_than_days` and `checkpoint` select entries as `selected_entries` does. `clear` asks
    first (`confirm_on_terminal`) unless `yes`; with neither a terminal nor `yes` it refuses (ValueError)
    before looking at anything."""
    root = Path(root).expanduser()
    if clear and not yes and not sys.stdin.isatty():  # refused before anything else, empty cache or not
        raise ValueError(NO_TERMINAL)
    entries = selected_entries(root, older_than_days, checkpoint)
    which = "" if older_than_days is None else f" older than {older_than_days:g} days"
    if not entries:
        if checkpoint is None:
            return f"no cache entries in {root}{which}"
        held = sorted({e.checkpoint for e in cache_entries(root)})  # so a mistyped --ckpt shows
        return f"no cache entries of {checkpoint} in {root}{which}" + (
            f"; it holds entries of: {', '.join(held)}" if held else ""
        )
    total = format_size(sum(e.size for e in entries))
    if clear:
        if not yes and not confirm_on_terminal(
            f"remove {_entries_text(len(entries))} ({total}) from {root}?"
        ):
            return "nothing removed"
        removed = clear_cache(root, older_than_days, checkpoint)
        return (
            f"removed {_entries_text(len(removed))} ({format_size(sum(e.size for e in removed))}) from {root}; "
            f"{format_size(cache_size(root))} left"
        )
    now = time.time()
    lines = []
    by_checkpoint: dict[str, list[CacheEntry]] = {}
    for e in entries:
        by_checkpoint.setdefault(e.checkpoint, []).append(e)
    for name, mine in by_checkpoint.items():
        lines.append(f"{name}  ({format_size(sum(e.size for e in mine))})")
        for e in mine:
            what = ", ".join(e.uses) or "?"
            about = f"  {e.about!r}" if e.about else ""
            flag = "" if e.complete else "  (partial)"
            lines.append(
                f"  {format_size(e.size):>9}  {e.age_days(now):5.1f}d  {e.n_sequences:>6} seqs  "
                f"{what}: {e.sites}{about}{flag}"
            )
    lines.append(
        f"{total:>11}  total in {len(entries)} entries of {len(by_checkpoint)} checkpoint"
        f"{'' if len(by_checkpoint) == 1 else 's'} under {root}{which} "
        "('lime-probe cache --clear [--ckpt DIR]' removes them)"
    )
    return "\n".join(lines)


@contextlib.contextmanager
def report_growth(root: str | os.PathLike | None, stream: TextIO | None = None) -> Iterator[None]:
    """Print to `stream` (stderr) how much the block added to the cache at `root`, if anything
    (also when the block fails: an interrupted extraction keeps its shards for resuming)."""
    before = cache_size(root)
    try:
        yield
    finally:
        after = cache_size(root)
        if after > before and root is not None:
            print(
                f"cache: +{format_size(after - before)} in {Path(root).expanduser()} "
                f"({format_size(after)} in all; 'lime-probe cache' lists and clears it)",
                file=stream or sys.stderr,
            )
