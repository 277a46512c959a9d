"""The activation cache folder as a whole: list its entries with their sizes, clear them, report growth,
keep it under a size limit, and remove what killed runs left behind.

``lime-probe cache`` is `cache_report`; the analysis commands wrap their work in `report_growth` (which then
evicts least recently used entries down to ``--cache-limit``), and each analysis in `cache_use`, so the
entries it writes or reuses record what they were for. This module needs no torch, so listing or clearing
the cache starts at once. The entries are the folders `lime_probe.extraction.cache.ShardCache` writes
(``<prefix>-<16 hex digits>/`` with a manifest); nothing else under the cache root is listed or removed.

Each entry holds two empty bookkeeping files: `STAMP`, touched whenever the entry is opened (read or
written), so the newest mtime in the folder is its last use; and, while a process writes it, a marker
``WRITER + owner_tag()`` naming that process. Temporary files (``.*.tmp``) in an entry without a live
writer were left by a killed run and are removed when the cache is next looked at; the staging folders of
``--out`` carry the same tag (`remove_stale_staging`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Collection, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

MANIFEST = "manifest.json"
STAMP = ".last-used"  # its mtime: when the entry was last read or written
WRITER = ".writer."  # + owner_tag(): the process writing the entry
DEFAULT_LIMIT = "5GB"  # --cache-limit's default: what a laptop's disk holds beside everything else

_ENTRY_NAME = re.compile(r"^[\w.-]+-[0-9a-f]{16}$")  # "<prefix>-<key hash>", as ShardCache names its folders

# The entry folders opened in the current `report_growth` block (None outside one): never evicted by it.
_OPENED: ContextVar[set[Path] | None] = ContextVar("lime_probe_cache_opened", default=None)

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


def opened(directory: Path) -> None:
    """Record that the entry `directory` is read or written now: its `STAMP` is touched (its last use, for
    least-recently-used eviction), and the enclosing `report_growth` block will not evict it."""
    (directory / STAMP).touch()
    if (mine := _OPENED.get()) is not None:
        mine.add(directory.resolve())


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname()) or "host"


_TAG = re.compile(r"(\d+)@([\w.-]+)")


def owner_tag() -> str:
    """This process as ``<pid>@<host>``, for names of files and folders it is writing and may leave behind
    if it is killed (`owner_alive` tells later whether they are still in use)."""
    return f"{os.getpid()}@{_host()}"


def owner_alive(tag: str) -> bool:
    """Whether the process an `owner_tag` names may still run: False only for a process of this host that
    has gone (a tag of another host, or one this cannot check, counts as alive, so nothing of a running
    process is ever removed)."""
    match = _TAG.fullmatch(tag)
    if match is None or match[2] != _host() or os.name == "nt" or int(match[1]) <= 0:
        return True
    try:
        os.kill(int(match[1]), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, owned by someone else
        return True
    return True


def clean_entry(directory: Path) -> bool:
    """Remove the writer markers of gone processes in the entry `directory` and, if no live process writes it,
    the temporary files a killed writer left there; return whether a live process writes it."""
    markers = list(directory.glob(WRITER + "*"))
    gone = [m for m in markers if not owner_alive(m.name[len(WRITER) :])]
    writing = len(gone) < len(markers)
    for path in gone + ([] if writing else list(directory.glob(".*.tmp"))):
        with contextlib.suppress(OSError):  # someone else's cache we may only read: left as it is
            path.unlink(missing_ok=True)
    return writing


_STAGING = re.compile(r"\..+\.(\d+@[\w.-]+)\.\w+\.partial")  # staging_prefix(out) + mkdtemp's suffix


def staging_prefix(out: Path) -> str:
    """The name prefix of a staging folder of `out` (beside it), naming this process (`owner_tag`)."""
    return f".{out.name}.{owner_tag()}."


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging folders in `parent` (named by `staging_prefix`, ending ``.partial``) whose process
    is gone (killed before it could clean up); return them. Folders of running processes, and anything
    else, are left alone."""
    removed = []
    with contextlib.suppress(OSError):  # an unreadable parent holds nothing of ours
        for folder in parent.iterdir():
            match = _STAGING.fullmatch(folder.name)
            if match and folder.is_dir() and not folder.is_symlink() and not owner_alive(match[1]):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


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
    used: float  # newest mtime of its files, `STAMP` included (epoch seconds): its last read or write
    writing: bool  # a live process is writing it

    def age_days(self, now: float | None = None) -> float:
        """Days since it was last used."""
        return ((time.time() if now is None else now) - self.used) / 86400


def _folder_size(folder: Path) -> tuple[int, float]:
    """(bytes, newest mtime) of the files under `folder` (the folder's own mtime if it holds none: removing a
    file, a finished writer's marker, is no use of the entry)."""
    size, newest = 0, None
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):  # a file removed while we look
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                newest = max(newest or 0.0, st.st_mtime)
    return size, folder.stat().st_mtime if newest is None else newest


def _describe_key(key: dict[str, Any]) -> tuple[str, str]:
    ident = key.get("checkpoint", {})
    if "parameters" in ident:
        checkpoint = f"in-memory model {ident['parameters'][:12]}"
    else:
        checkpoint = str(ident.get("path") or ident.get("id") or "?")
    sites = ", ".join(key.get("settings", {}).get("sites", {}) or ())
    return checkpoint, sites or "?"


def cache_entries(root: str | os.PathLike) -> list[CacheEntry]:
    """Every cached extraction under `root` (folders named as `ShardCache` names them), least recently
    used first; the temporary files killed runs left in them are removed first (`clean_entry`).

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
        writing = clean_entry(folder)
        try:
            stored = json.loads((folder / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            stored = {}  # interrupted before its first shard, or unreadable: still counts, still removable
        checkpoint, sites = _describe_key(stored.get("key", {}))
        size, used = _folder_size(folder)
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
                used,
                writing,
            )
        )
    return sorted(entries, key=lambda e: (e.used, e.directory.name))


def cache_size(root: str | os.PathLike | None) -> int:
    """Bytes held by the cache entries under `root` (0 for None or a missing folder)."""
    return sum(e.size for e in cache_entries(root)) if root is not None else 0


def selected_entries(
    root: str | os.PathLike, older_than_days: float | None = None, checkpoint: str | None = None
) -> list[CacheEntry]:
    """The entries under `root` last used more than `older_than_days` days ago (all if None) and of
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
    """Remove the cache entries under `root` that `selected_entries` selects, except those a running process
    is writing; return them. Files that are not cache entries are left alone."""
    removed = [e for e in selected_entries(root, older_than_days, checkpoint) if not e.writing]
    for entry in removed:
        shutil.rmtree(entry.directory)
    return removed


def evict(root: str | os.PathLike, limit: int, keep: Collection[Path] = ()) -> list[CacheEntry]:
    """Remove whole entries under `root`, least recently used first, until they hold at most `limit` bytes;
    return them. The entries in `keep` (resolved folders) and those a running process writes are never
    removed, so the cache may stay over `limit`."""
    entries = cache_entries(root)
    total = sum(e.size for e in entries)
    removed = []
    for entry in entries:
        if total <= limit:
            break
        if entry.writing or entry.directory.resolve() in keep:
            continue
        shutil.rmtree(entry.directory, ignore_errors=True)
        total -= entry.size
        removed.append(entry)
    return removed


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """A size in bytes from ``text``: a number with an optional decimal unit (B, kB, MB, GB, TB; the B and
    the case optional: "5GB", "500m", "1.5 GB") or a binary one (KiB, MiB, GiB, TiB); else ValueError
    naming it."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt]?)b?|([kmgt])ib)\s*", text.lower())
    if match is None:
        raise ValueError(f"expected a size such as 5GB, 500MB or 0, got {text!r}")
    unit = _UNITS[match[2]] if match[3] is None else 1024 ** ("kmgt".index(match[3]) + 1)
    return round(float(match[1]) * unit)


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
        busy = len(entries) - len(removed)
        return (
            f"removed {_entries_text(len(removed))} ({format_size(sum(e.size for e in removed))}) from {root}; "
            f"{format_size(cache_size(root))} left"
            + (f" ({_entries_text(busy)} being written by a running process kept)" if busy else "")
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
            flag = "  (being written)" if e.writing else "" if e.complete else "  (partial)"
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
def report_growth(
    root: str | os.PathLike | None, limit: int | None = None, stream: TextIO | None = None
) -> Iterator[None]:
    """Print to `stream` (stderr) how much the block added to the cache at `root`, if anything (also when
    the block fails: an interrupted extraction keeps its shards for resuming); then, unless it was
    interrupted (Ctrl-C), evict least recently used entries until the cache holds at most `limit` bytes
    (`evict`; None or 0: no limit), never one the block opened (`opened`), saying what was removed."""
    token = _OPENED.set(set())
    before = cache_size(root)
    interrupted = True
    try:
        yield
        interrupted = False
    except Exception:
        interrupted = False
        raise
    finally:
        mine = _OPENED.get() or set()
        _OPENED.reset(token)
        if root is not None:
            _settle(
                Path(root).expanduser(), before, None if interrupted else limit, mine, stream or sys.stderr
            )


def _settle(root: Path, before: int, limit: int | None, keep: set[Path], stream: TextIO) -> None:
    """`report_growth`'s lines after its block: the growth, then the eviction down to `limit`."""
    after = cache_size(root)
    if after > before:
        print(
            f"cache: +{format_size(after - before)} in {root} "
            f"({format_size(after)} in all; 'lime-probe cache' lists and clears it)",
            file=stream,
        )
    if not limit or after <= limit:
        return
    removed = evict(root, limit, keep)
    left = cache_size(root)
    if removed:
        print(
            f"cache: removed the {_entries_text(len(removed))} least recently used "
            f"({format_size(sum(e.size for e in removed))}) to keep {root} within --cache-limit "
            f"{format_size(limit)}",
            file=stream,
        )
    if left > limit:
        print(
            f"cache: {root} holds {format_size(left)}, over --cache-limit {format_size(limit)}, in entries "
            "this run used or a running process writes: kept",
            file=stream,
        )
