"""The activation cache folder as a whole: list its entries with their sizes, clear them, report growth.

``lime-probe cache`` is `cache_report`; the analysis commands wrap their work in `report_growth`.
This module needs no torch, so listing or clearing the cache starts at once. The entries are the
folders `lime_probe.cache.ShardCache` writes (``<prefix>-<16 hex digits>/`` with a manifest); nothing
else under the cache root is listed or removed.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

MANIFEST = "manifest.json"

_ENTRY_NAME = re.compile(r"^[\w.-]+-[0-9a-f]{16}$")  # "<prefix>-<key hash>", as ShardCache names its folders


@dataclass(frozen=True)
class CacheEntry:
    """One cached extraction under a cache root: its folder, what it holds and how big it is."""

    directory: Path
    checkpoint: str  # the checkpoint's path or hub id, or "in-memory model <hash>"
    sites: str  # e.g. "hidden, values"
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
        entries.append(
            CacheEntry(folder, checkpoint, sites, n_sequences, bool(stored.get("complete")), size, modified)
        )
    return sorted(entries, key=lambda e: (e.modified, e.directory.name))


def cache_size(root: str | os.PathLike | None) -> int:
    """Bytes held by the cache entries under `root` (0 for None or a missing folder)."""
    return sum(e.size for e in cache_entries(root)) if root is not None else 0


def clear_cache(root: str | os.PathLike, older_than_days: float | None = None) -> list[CacheEntry]:
    """Remove the cache entries under `root` (only those last written more than `older_than_days` days
    ago, if given); return the removed entries. Files that are not cache entries are left alone."""
    if older_than_days is not None and older_than_days < 0:
        raise ValueError(f"--older-than must be a number of days >= 0, got {older_than_days}")
    now = time.time()
    removed = []
    for entry in cache_entries(root):
        if older_than_days is None or entry.age_days(now) > older_than_days:
            shutil.rmtree(entry.directory)
            removed.append(entry)
    return removed


def format_size(n_bytes: float) -> str:
    """Bytes in decimal units: "0 B", "512 B", "1.5 kB", "601.2 MB"."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n_bytes) < 1000 or unit == "GB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    raise AssertionError("unreachable")


def cache_report(
    root: str | os.PathLike, *, clear: bool = False, older_than_days: float | None = None
) -> str:
    """What ``lime-probe cache`` prints: one line per entry (size, age, sequences, sites, checkpoint)
    and the total, or, with `clear`, what was removed. `older_than_days` limits both to older entries."""
    root = Path(root).expanduser()
    if clear:
        removed = clear_cache(root, older_than_days)
        left = cache_size(root)
        return (
            f"removed {len(removed)} cache entr{'y' if len(removed) == 1 else 'ies'} "
            f"({format_size(sum(e.size for e in removed))}) from {root}; {format_size(left)} left"
        )
    if older_than_days is not None and older_than_days < 0:
        raise ValueError(f"--older-than must be a number of days >= 0, got {older_than_days}")
    now = time.time()
    entries = [e for e in cache_entries(root) if older_than_days is None or e.age_days(now) > older_than_days]
    if not entries:
        return f"no cache entries in {root}" + (
            "" if older_than_days is None else f" older than {older_than_days:g} days"
        )
    lines = [f"{'size':>9}  {'age':>6}  {'seqs':>6}  sites / checkpoint"]
    for e in entries:
        flag = "" if e.complete else "  (partial)"
        lines.append(
            f"{format_size(e.size):>9}  {e.age_days(now):5.1f}d  {e.n_sequences:>6}  {e.sites} / {e.checkpoint}{flag}"
        )
    total = sum(e.size for e in entries)
    lines.append(f"{format_size(total):>9}  total in {len(entries)} entries under {root}")
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
        if after > before:
            print(
                f"cache: +{format_size(after - before)} in {Path(root).expanduser()} "
                f"({format_size(after)} in all; 'lime-probe cache' lists and clears it)",
                file=stream or sys.stderr,
            )
