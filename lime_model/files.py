"""All-or-nothing file and folder writes, shared by lime_model and lime_probe.

Everything is written under a temporary name in the destination's own folder (so the final
``os.replace`` is a same-filesystem rename) and renamed into place only once complete: a reader or
a crashed run never sees a half-written file. The results get the permissions a plain ``open()``
or ``mkdir()`` would give them (0o666 / 0o777 minus the umask), not mkstemp's private 0o600/0o700.

* ``atomic_write`` -- text or bytes, or a function that writes into the open binary file;
* ``atomic_path`` -- a temporary path for writers that want a file name (safetensors'
  ``save_file``, matplotlib's ``savefig``);
* ``atomic_dir`` -- a temporary folder, published as a whole;
* ``check_writable`` -- before any work, whether an output file or folder can be written;
* ``naming_disk_full`` -- a write that runs out of space as one ``DiskFullError`` naming the
  file or folder (the atomic writes above raise it).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "DiskFullError",
    "atomic_dir",
    "atomic_path",
    "atomic_write",
    "check_writable",
    "naming_disk_full",
    "umask",
]

_NO_SPACE = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # a full disk, or a full quota


class DiskFullError(OSError):
    """A write found no space left: ``filename`` is the file or folder it was writing (errno ENOSPC)."""


def _is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` says a write ran out of space. Python's own writes give the errno; numpy's short
    write an errno-less ``N requested and M written``; safetensors (and transformers' saves through it)
    a text ending in ``(os error 28)``."""
    if isinstance(error, OSError) and error.errno in _NO_SPACE:
        return True
    text = str(error)
    if (
        isinstance(error, OSError)
        and error.errno is None
        and re.fullmatch(r"\d+ requested and \d+ written", text)
    ):
        return True
    return any(f"(os error {code})" in text for code in _NO_SPACE)


@contextmanager
def naming_disk_full(path: str | os.PathLike) -> Iterator[None]:
    """Raise a ``DiskFullError`` naming ``path`` when a write inside runs out of space (its one line:
    the path, and that the disk is full); other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if not _is_disk_full(e):
            raise
        raise DiskFullError(
            errno.ENOSPC, "no space left on the disk (free some and run it again)", str(path)
        ) from e


@cache
def umask() -> int:
    """The process umask (read once: reading it means setting it, so it is set straight back)."""
    old = os.umask(0)
    os.umask(old)
    return old


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary file path beside ``path``; on normal exit it is fsynced, given mode
    ``0o666 & ~umask`` and renamed onto ``path``. On an exception it is deleted and ``path`` is
    untouched (out of space: ``DiskFullError`` naming ``path``). The parent folder must exist.

    >>> with atomic_path("model.safetensors") as tmp:  # doctest: +SKIP
    ...     save_file(tensors, tmp)
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        with naming_disk_full(path):
            yield tmp
            _fsync(tmp)
            os.chmod(tmp, 0o666 & ~umask())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, content: str | bytes | Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` all or nothing and return it (as a ``Path``).

    ``content`` is text (written as UTF-8, newlines untranslated), bytes, or a function called with
    the open binary file. The parent folder must exist.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        if callable(content):
            content(f)
        else:
            f.write(content.encode() if isinstance(content, str) else content)
    return Path(path)


@contextmanager
def atomic_dir(path: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``path``; on normal exit it gets mode ``0o777 & ~umask``
    and replaces ``path`` (an existing folder at ``path`` is deleted first; with ``replace=False`` only an
    empty one is replaced, else OSError ENOTEMPTY: another writer came first). On an exception the
    temporary folder is deleted and ``path`` is untouched (out of space: ``DiskFullError`` naming
    ``path``). The parent folder must exist.
    """
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        with naming_disk_full(path):  # also the temporary names of the files written inside
            yield tmp
            for f in [*tmp.rglob("*"), tmp]:
                _fsync(f)
        os.chmod(tmp, 0o777 & ~umask())
        if replace and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)  # os.replace cannot overwrite a non-empty folder
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_writable(path: str | os.PathLike, *, folder: bool = False, option: str = "--out") -> None:
    """Raise, naming ``option`` and ``path``, unless ``path`` can be written: a file (the default) or a
    folder to create or fill (``folder``). Missing parent folders count as creatable when the nearest
    existing one is writable. Writability is tried with a real temporary file there, removed at once:
    permission bits say nothing for root, nor on a read-only or virtual file system such as /proc.

    Raises:
        IsADirectoryError: a file ``path`` that is an existing folder.
        NotADirectoryError: a file on the way is not a folder.
        PermissionError: the folder that would hold ``path`` cannot be written (the reason in brackets).
    """
    path = Path(path).expanduser()
    if not folder and path.is_dir():
        raise IsADirectoryError(f"{option} {path} is a folder: give a file name")
    base = path if folder else path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise NotADirectoryError(f"{option} {path}: {base} is not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=base, prefix=".write-check.", suffix=".tmp")
    except OSError as e:
        raise PermissionError(f"{option} {path}: cannot write in {base} ({e.strerror})") from None
    os.close(fd)
    os.unlink(name)
