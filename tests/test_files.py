"""The shared atomic writers: all or nothing, and the permissions a plain open()/mkdir() would give."""

import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from lime_model import files


@pytest.fixture(params=[0o022, 0o077, 0o002])
def mask(request):
    """Run under a given umask (the writer caches it, so the cache is reset around the test)."""
    old = os.umask(request.param)
    files.umask.cache_clear()
    yield request.param
    os.umask(old)
    files.umask.cache_clear()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_and_dirs_get_the_modes_of_plain_open_and_mkdir(tmp_path, mask):
    plain_file, plain_dir = tmp_path / "plain.txt", tmp_path / "plain"
    plain_file.write_text("x")
    plain_dir.mkdir()
    text = files.atomic_write(tmp_path / "a.txt", "héllo\r\n")
    assert text.read_bytes() == "héllo\r\n".encode()
    files.atomic_write(tmp_path / "b.bin", b"\x00\x01")
    files.atomic_write(tmp_path / "c.bin", lambda f: f.write(b"cb"))
    with files.atomic_path(tmp_path / "d.safetensors") as tmp:
        save_file({"w": torch.arange(3.0)}, str(tmp))
    with files.atomic_dir(tmp_path / "folder") as tmp:
        (tmp / "inner.txt").write_text("in")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01" and (tmp_path / "c.bin").read_bytes() == b"cb"
    assert torch.equal(load_file(tmp_path / "d.safetensors")["w"], torch.arange(3.0))
    assert (tmp_path / "folder" / "inner.txt").read_text() == "in"
    for name in ("a.txt", "b.bin", "c.bin", "d.safetensors"):
        assert mode(tmp_path / name) == mode(plain_file) == 0o666 & ~mask, name
    assert mode(tmp_path / "folder") == mode(plain_dir) == 0o777 & ~mask


def test_a_failed_write_leaves_the_old_content_and_no_temporary(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        files.atomic_write(target, boom)
    with pytest.raises(KeyError), files.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise KeyError
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep").write_text("old")
    with pytest.raises(KeyError), files.atomic_dir(tmp_path / "d") as tmp:
        (tmp / "new").write_text("half")
        raise KeyError
    assert target.read_text() == "old"
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["keep"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "t.txt"]


def test_atomic_dir_replaces_an_existing_folder_whole(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stale").write_text("old")
    with files.atomic_dir(tmp_path / "d") as tmp:
        (tmp / "fresh").write_text("new")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["fresh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_missing_parent_folder_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.atomic_write(tmp_path / "nope" / "x.txt", "x")
