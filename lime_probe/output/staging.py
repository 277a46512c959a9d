"""A command's output folder published whole: written in a hidden folder beside it, moved in on success."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from lime_model.files import check_writable, umask
from lime_probe.extraction.cachedir import remove_stale_staging, staging_prefix


@contextmanager
def staged_output(out: str | os.PathLike):
    """Yield a fresh temp folder beside ``out``; on success move its files into ``out``.

    Missing parent folders are created (as ``mkdir -p``) and removed again if the command fails.
    On any exception (including KeyboardInterrupt) the temp folder is removed and ``out`` is
    left as it was. The temp folder's name holds this process's id, so the staging folders of killed runs
    (``kill -9``) are removed here by the next run (`lime_probe.extraction.cachedir.remove_stale_staging`).
    A new ``out`` gets the mode a plain ``mkdir`` gives (0o777 & ~umask), not mkdtemp's private 0o700.
    ``out`` is checked first, creating nothing (``lime_model.files.check_writable``): NotADirectoryError
    if it or a folder on its way is a file, PermissionError if it cannot be written.
    """
    out = Path(out)
    check_writable(out, folder=True, option="--out")  # before any folder is made
    parent = out.resolve().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]  # innermost first
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PermissionError(f"--out {out}: cannot create {parent} ({e.strerror})") from None
    published = False
    try:
        try:
            remove_stale_staging(parent)  # those of runs killed before they could remove their own
            tmp = Path(tempfile.mkdtemp(prefix=staging_prefix(out), suffix=".partial", dir=parent))
        except OSError as e:
            raise PermissionError(f"--out {out} is not writable ({e.strerror})") from None
        try:
            yield tmp
            os.chmod(tmp, 0o777 & ~umask())
            if not out.exists():
                os.replace(tmp, out)
            else:
                for item in sorted(tmp.rglob("*")):
                    target = out / item.relative_to(tmp)
                    if item.is_dir():
                        target.mkdir(exist_ok=True)
                    else:
                        os.replace(item, target)
            published = True
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if not published:
            for folder in created:
                with contextlib.suppress(OSError):
                    folder.rmdir()
