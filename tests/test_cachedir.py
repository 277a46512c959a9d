"""The cache folder as a whole: `lime-probe cache` lists sizes, clears (all or older entries), and
commands say how much they added. Sizes are checked against a plain walk of the files on disk."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, save_tiny_checkpoint

from lime_probe import cli
from lime_probe.extraction.cachedir import (
    cache_entries,
    cache_report,
    cache_size,
    clear_cache,
    format_size,
    report_growth,
)


def du(folder: Path) -> int:
    """Bytes of the regular files under `folder`, by os.walk (independent of cachedir's own walk)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


@pytest.fixture
def filled(tmp_path, ckpt) -> Path:
    """A cache with two real extractions of `ckpt` (two sites) and two things that are not entries."""
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract

    cache = tmp_path / "cache"
    model, tok = load(ckpt)
    for site in ("hidden", "values"):
        extract(model, tok, CORPUS[:3], sites=[site], cache_dir=cache, progress=False)
    (cache / "notes.txt").write_text("mine, keep")
    (cache / "photos").mkdir()
    (cache / "photos" / "a.jpg").write_bytes(b"x" * 1000)
    return cache


def age(folder: Path, days: float) -> None:
    """Make every file under `folder` (and the folder) look last written `days` ago."""
    then = time.time() - days * 86400
    for path in [*folder.rglob("*"), folder]:
        os.utime(path, (then, then))


def test_entries_and_sizes_match_the_files_on_disk(filled, ckpt):
    entries = cache_entries(filled)
    assert len(entries) == 2
    entry_dirs = sorted(p for p in filled.iterdir() if (p / "manifest.json").is_file())
    assert sorted(e.directory for e in entries) == entry_dirs
    for e in entries:
        assert e.size == du(e.directory) > 0
        assert e.checkpoint == str(ckpt.resolve()) and e.complete and e.n_sequences == 3
    assert sorted(e.sites for e in entries) == ["hidden", "values"]
    assert cache_size(filled) == sum(du(d) for d in entry_dirs)  # notes.txt and photos/ are not counted
    text = cache_report(filled)
    assert f"{format_size(cache_size(filled))}  total in 2 entries of 1 checkpoint under {filled}" in text
    assert text.splitlines()[0] == f"{ckpt.resolve()}  ({format_size(cache_size(filled))})"  # grouped


def test_clear_older_than_and_all_leave_other_files_alone(filled):
    old, new = cache_entries(filled)
    age(old.directory, 40)
    assert [e.directory for e in cache_entries(filled)][0] == old.directory  # oldest first
    listed = cache_report(filled, older_than_days=30)
    assert old.directory.name not in listed and "total in 1 entries" in listed
    assert "values" in listed or "hidden" in listed
    removed = clear_cache(filled, older_than_days=30)
    assert [e.directory for e in removed] == [old.directory]
    assert not old.directory.exists() and new.directory.exists()
    text = cache_report(filled, clear=True, yes=True)
    assert text.startswith(f"removed 1 cache entry ({format_size(new.size)}) from {filled}; 0 B left")
    assert not new.directory.exists()
    assert (filled / "notes.txt").read_text() == "mine, keep" and (filled / "photos" / "a.jpg").is_file()
    assert cache_report(filled) == f"no cache entries in {filled}"


def test_bad_age_and_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="--older-than must be a number of days >= 0"):
        clear_cache(tmp_path, older_than_days=-1)
    assert cache_entries(tmp_path / "nowhere") == [] and cache_size(None) == 0


def test_format_size():
    assert [format_size(n) for n in (0, 999, 1000, 1_500, 601_234_567, 2.5e12)] == [
        "0 B",
        "999 B",
        "1.0 kB",
        "1.5 kB",
        "601.2 MB",
        "2500.0 GB",
    ]


def test_report_growth_prints_the_bytes_added(tmp_path, capsys):
    cache = tmp_path / "cache"
    entry = cache / "llama-0123456789abcdef"
    with report_growth(cache):
        entry.mkdir(parents=True)
        (entry / "manifest.json").write_text(json.dumps({"key": {}, "shards": []}))
        (entry / "shard-00000.safetensors").write_bytes(b"\0" * 2_345)
    added = du(entry)
    assert capsys.readouterr().err.startswith(f"cache: +{format_size(added)} in {cache} ")
    with report_growth(cache):  # nothing added: nothing said
        pass
    assert capsys.readouterr().err == ""


def test_cli_cache_lists_and_clears(filled, capsys):
    total = cache_size(filled)
    assert cli.main(["cache", "--cache", str(filled)]) == 0
    assert f"{format_size(total)}  total in 2 entries" in capsys.readouterr().out
    assert cli.main(["cache", "--cache", str(filled), "--clear", "--yes"]) == 0
    assert capsys.readouterr().out.startswith(f"removed 2 cache entries ({format_size(total)})")
    assert cache_entries(filled) == [] and (filled / "notes.txt").is_file()
    assert cli.main(["cache", "--cache", str(filled), "--older-than", "-2"]) == 2
    assert "--older-than must be a number of days >= 0" in capsys.readouterr().err


def test_commands_report_cache_growth_and_record_threads(tmp_path, ckpt, capsys):
    data = tmp_path / "t.txt"
    data.write_text("\n\n".join(CORPUS) + "\n")
    cache, out = tmp_path / "cache", tmp_path / "out"
    before = torch.get_num_threads()
    try:
        argv = ["entropy", "--ckpt", ckpt, "--data", data, "--cache", cache, "--out", out, "--threads", "1"]
        argv += ["--unit", "documents"]  # six short texts: fewer tokens than one default window
        assert cli.main([str(a) for a in argv]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert f"cache: +{format_size(du(cache))} in {cache} " in err
    (doc,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert doc["meta"]["settings"]["threads"] == 1


class _Terminal:
    """A stand-in stdin that is a terminal and answers `answer`."""

    def __init__(self, answer: str):
        self.answer = answer

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        return self.answer + "\n"


class _Pipe(_Terminal):
    def isatty(self) -> bool:
        return False


def test_clear_asks_on_a_terminal_and_refuses_without_one(filled, capsys, monkeypatch):
    before = [e.directory for e in cache_entries(filled)]
    argv = ["cache", "--cache", str(filled), "--clear"]
    monkeypatch.setattr("sys.stdin", _Pipe("y"))  # a script: nobody to ask
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "stdin is not a terminal: add --yes" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr("sys.stdin", _Terminal("n"))
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"remove 2 cache entries ({format_size(cache_size(filled))}) from {filled}? [y/N]" in out
    assert "nothing removed" in out
    assert [e.directory for e in cache_entries(filled)] == before  # untouched by both
    monkeypatch.setattr("sys.stdin", _Terminal("y"))
    assert cli.main(argv) == 0
    assert "removed 2 cache entries" in capsys.readouterr().out and cache_entries(filled) == []


def test_entries_are_named_by_checkpoint_and_analysis_and_cleared_per_checkpoint(tmp_path, ckpt, capsys):
    """Two BLiMP-like extractions (same checkpoint, site and settings, different sentences) are told apart
    by their data; a second analysis reusing an entry is recorded; --ckpt lists and clears one checkpoint."""
    from lime_probe.extraction.cachedir import cache_use
    from lime_probe.extraction.loading import load
    from lime_probe.extraction.tracing import extract

    other = save_tiny_checkpoint(tmp_path / "lime", "lime")
    cache = tmp_path / "cache"
    model, tok = load(ckpt)
    good, bad = ["The cats are here.", "A dog barks."], ["The cats is here.", "A dog bark."]
    with cache_use("blimp"):
        for texts in (good, bad):
            extract(model, tok, texts, sites=["hidden"], pool="mean", cache_dir=cache, progress=False)
    with cache_use("cka"):  # the same extraction again: reused, and recorded as used by cka too
        extract(model, tok, good, sites=["hidden"], pool="mean", cache_dir=cache, progress=False)
    lime, lime_tok = load(other)
    with cache_use("entropy"):
        extract(lime, lime_tok, CORPUS[:2], sites=["values"], cache_dir=cache, progress=False)
    entries = cache_entries(cache)
    assert len(entries) == 3
    uses = {e.about: e.uses for e in entries}
    assert uses["The cats are here."] == ("blimp", "cka") and uses["The cats is here."] == ("blimp",)
    assert uses[" ".join(CORPUS[0].split())[:45] + "..."] == ("entropy",)

    assert cli.main(["cache", "--cache", str(cache)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("  (")[0] for ln in lines if not ln.startswith(" ")] == [
        str(ckpt.resolve()),
        str(other.resolve()),
    ]
    assert any("blimp, cka: hidden  'The cats are here.'" in ln for ln in lines)
    assert any("blimp: hidden  'The cats is here.'" in ln for ln in lines)
    assert "total in 3 entries of 2 checkpoints" in lines[-1]

    assert cli.main(["cache", "--cache", str(cache), "--ckpt", str(other)]) == 0
    listed = capsys.readouterr().out
    assert str(other.resolve()) in listed and str(ckpt.resolve()) not in listed
    kept = du(next(e.directory for e in entries if e.checkpoint == str(other.resolve())))
    assert cli.main(["cache", "--cache", str(cache), "--clear", "--yes", "--ckpt", str(ckpt)]) == 0
    assert capsys.readouterr().out.startswith("removed 2 cache entries ")
    assert [e.checkpoint for e in cache_entries(cache)] == [str(other.resolve())] and cache_size(
        cache
    ) == kept
    assert (
        cli.main(["cache", "--cache", str(cache), "--clear", "--yes", "--ckpt", str(tmp_path / "nope")]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(f"no cache entries of {tmp_path / 'nope'}") and str(other.resolve()) in out
    assert len(cache_entries(cache)) == 1
