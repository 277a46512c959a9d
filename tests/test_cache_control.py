"""The activation cache under the user's control: the estimate printed before a run writes (checked against
the bytes the shards hold, read from the files' safetensors headers), the size limit with least-recently-used
eviction (order and protection of the run's own entries), the per-user default, and the removal of what a
killed run leaves behind (staging folders beside --out, temp files in an entry) only once its owner is gone."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import CORPUS, save_tiny_checkpoint, tiny_model, tiny_tokenizer

import lime_probe.extraction.tracing as ex
from lime_probe import cli
from lime_probe.extraction.cachedir import (
    STAMP,
    WRITER,
    cache_entries,
    cache_report,
    cache_size,
    evict,
    format_size,
    owner_tag,
    parse_size,
    report_growth,
    staging_prefix,
)
from lime_probe.extraction.settings import default_cache
from lime_probe.output.staging import staged_output

HIDDEN, VALUES, LAYERS = 32, 16, 2  # the tiny LLaMA: hidden size, K/V width (2 heads of 8), blocks


def du(folder: Path) -> int:
    """Bytes of the regular files under `folder`, by os.walk."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def tensor_bytes(shard: Path) -> int:
    """The bytes of a safetensors file's tensors: its size less the 8-byte length and the JSON header."""
    with open(shard, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return shard.stat().st_size - 8 - header


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def estimate_line(err: str) -> str:
    (line,) = [ln for ln in err.splitlines() if ln.startswith("cache: this run adds")]
    return line


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def fake_entry(root: Path, name: str, size: int, used_days_ago: float, checkpoint: str = "/runs/a") -> Path:
    """A cache entry folder of `size` bytes of shard (plus its manifest), last used `used_days_ago` days ago."""
    folder = root / f"llama-{name:0>16}"
    folder.mkdir(parents=True)
    manifest = {
        "key": {"checkpoint": {"path": checkpoint}, "settings": {"sites": {"hidden": [0]}}},
        "shards": [],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "shard-00000.safetensors").write_bytes(b"\0" * size)
    then = time.time() - used_days_ago * 86400
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (then, then))
    return folder


# --------------------------------------------------------------------------- the estimate


def test_estimate_is_printed_before_writing_and_matches_the_shards(tok, tmp_path, capsys, monkeypatch):
    model = tiny_model("llama", tok)
    printed_before_first_shard = []
    add_shard = ex.ShardCache.add_shard

    def spy(self, tensors):
        printed_before_first_shard.append("cache: this run adds" in capsys.readouterr().err)
        return add_shard(self, tensors)

    monkeypatch.setattr(ex.ShardCache, "add_shard", spy)
    acts = ex.extract(model, tok, CORPUS, sites=["hidden", "values"], cache_dir=tmp_path, batch_size=2)
    assert printed_before_first_shard == [True]
    tokens = sum(len(tok(t)["input_ids"]) for t in CORPUS)  # every token a row (no pooling, no selection)
    assert acts.token_ids.shape == (tokens,)
    # widths x layers x 4 bytes per row (hidden: embeddings and each block's output), an int64 token id per
    # row, an int64 offset and a float64 log-probability slot per sequence
    expected = tokens * (4 * (HIDDEN * (LAYERS + 1) + VALUES * LAYERS) + 8) + 16 * len(CORPUS)
    (entry,) = tmp_path.iterdir()
    (shard,) = entry.glob("shard-*.safetensors")
    # what the shard really holds: the estimate counts no log-probabilities (not asked for) and one offset
    # per sequence where the shard holds n + 1: off by 8 bytes per sequence less 8, nothing else
    assert expected - tensor_bytes(shard) == 8 * len(CORPUS) - 8
    # the whole entry adds the safetensors header and the manifest (its key): within 5% + 4 kB here
    assert abs(du(entry) - expected) <= 0.05 * expected + 4096


def test_estimate_line_names_the_cache_and_the_size(tok, tmp_path, capsys):
    model = tiny_model("llama", tok)
    ex.extract(model, tok, CORPUS[:4], sites=["hidden"], pool="mean", cache_dir=tmp_path)
    err = capsys.readouterr().err
    expected = 4 * (4 * HIDDEN * (LAYERS + 1) + 8) + 16 * 4  # one row per sequence
    assert estimate_line(err) == f"cache: this run adds about {format_size(expected)} under {tmp_path}"
    ex.extract(model, tok, CORPUS[:4], sites=["hidden"], pool="mean", cache_dir=tmp_path)
    assert "cache: this run adds" not in capsys.readouterr().err  # reused: nothing to add, nothing said


def test_a_resumed_run_estimates_only_what_is_left(tok, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ex, "SHARD_BYTES", 1)  # a shard per batch
    model = tiny_model("llama", tok)
    calls = []

    def interrupt(*args):
        calls.append(1)
        if len(calls) == 2:  # during the 2nd batch: the shard of the 1st (sequences 0-1) is written
            raise KeyboardInterrupt

    handle = model.base_model.layers[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        ex.extract(model, tok, CORPUS, sites=["hidden"], batch_size=2, cache_dir=tmp_path)
    handle.remove()
    capsys.readouterr()
    ex.extract(model, tok, CORPUS, sites=["hidden"], batch_size=2, cache_dir=tmp_path)
    rest = CORPUS[2:]
    tokens = sum(len(tok(t)["input_ids"]) for t in rest)
    expected = tokens * (4 * HIDDEN * (LAYERS + 1) + 8) + 16 * len(rest)
    assert estimate_line(capsys.readouterr().err).endswith(f"about {format_size(expected)} under {tmp_path}")


# --------------------------------------------------------------------------- the limit


def test_parse_size():
    assert [parse_size(s) for s in ("0", "5GB", "500MB", "1.5 gb", "2k", "700", "3B", "1GiB", "2MiB")] == [
        0,
        5 * 10**9,
        500 * 10**6,
        15 * 10**8,
        2000,
        700,
        3,
        2**30,
        2 * 2**20,
    ]
    for bad in ("", "-1GB", "5 XB", "GB", "1e9"):
        with pytest.raises(ValueError, match="expected a size such as 5GB, 500MB or 0"):
            parse_size(bad)


def test_eviction_removes_least_recently_used_first_and_spares_kept_and_written(tmp_path):
    root = tmp_path / "cache"
    ages = {"a": 50, "b": 40, "c": 30, "d": 20, "e": 10}  # days since last use: a is the least recent
    folders = {k: fake_entry(root, k, 1000, days) for k, days in ages.items()}
    size = du(folders["a"])  # every entry the same size: 1000 bytes of shard and its manifest
    (folders["b"] / (WRITER + owner_tag())).touch()  # being written by this (live) process
    keep = {folders["c"].resolve()}  # opened by the current run
    removed = evict(root, 3 * size, keep)
    # a goes (4 left); b is being written, c is kept; d goes (3 left): the limit holds, e (most recent) stays
    assert [e.directory for e in removed] == [folders["a"], folders["d"]]
    assert sorted(p.name[-1] for p in root.iterdir()) == ["b", "c", "e"]
    assert cache_size(root) == 3 * size == du(root)
    assert evict(root, 10**9) == []  # under the limit: nothing


def test_reading_an_entry_makes_it_recent(tok, tmp_path):
    model = tiny_model("llama", tok)
    texts = {"one": CORPUS[:2], "two": CORPUS[2:4]}
    folders = {}
    for name, part in texts.items():
        acts = ex.extract(model, tok, part, sites=["hidden"], cache_dir=tmp_path, progress=False)
        folders[name] = acts.shards[0].parent
    for name, hours in (("one", 2), ("two", 1)):  # last used (stamp and files) 2 and 1 hours ago
        then = time.time() - hours * 3600
        for path in [*folders[name].iterdir(), folders[name]]:
            os.utime(path, (then, then))
    assert (folders["one"] / STAMP).is_file()
    assert [e.directory for e in cache_entries(tmp_path)] == [folders["one"], folders["two"]]
    ex.extract(model, tok, texts["one"], sites=["hidden"], cache_dir=tmp_path, progress=False)  # read back
    assert [e.directory for e in cache_entries(tmp_path)] == [folders["two"], folders["one"]]
    (removed,) = evict(tmp_path, du(folders["one"]))
    assert removed.directory == folders["two"] and folders["one"].is_dir()


def test_report_growth_evicts_down_to_the_limit_but_never_the_blocks_entries(tok, tmp_path, capsys):
    model = tiny_model("llama", tok)
    old = fake_entry(tmp_path, "1", 5000, 5)
    old_size = du(old)
    with report_growth(tmp_path, limit=1):  # far below one entry: only what the block used may stay
        acts = ex.extract(model, tok, CORPUS[:2], sites=["hidden"], cache_dir=tmp_path, progress=False)
    mine = acts.shards[0].parent
    assert not old.exists() and [e.directory for e in cache_entries(tmp_path)] == [mine]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"cache: +{format_size(du(mine))} in {tmp_path} ({format_size(du(mine) + old_size)} in all; "
        "'lime-probe cache' lists and clears it)",
        f"cache: removed the 1 cache entry least recently used ({format_size(old_size)}) to keep {tmp_path} "
        "within --cache-limit 1 B",
        f"cache: {tmp_path} holds {format_size(du(mine))}, over --cache-limit 1 B, in entries this run used "
        "or a running process writes: kept",
    ]
    with report_growth(tmp_path, limit=0):  # 0: no limit
        fake_entry(tmp_path, "2", 5000, 5)
    assert len(cache_entries(tmp_path)) == 2


def test_cli_prints_the_estimate_first_and_keeps_the_limit(ckpt, tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text("\n\n".join(CORPUS) + "\n")
    cache = tmp_path / "cache"
    old = fake_entry(cache, "1", 40_000, 3)
    argv = ["entropy", "--ckpt", ckpt, "--data", data, "--cache", cache, "--out", tmp_path / "out"]
    argv += ["--unit", "documents", "--threads", "1", "--cache-limit", "30kB"]
    assert cli.main([str(a) for a in argv]) == 0
    err = capsys.readouterr().err.splitlines()
    at = {
        key: next(i for i, ln in enumerate(err) if ln.startswith(key)) for key in ("cache: this", "cache: +")
    }
    assert at["cache: this"] < at["cache: +"]
    assert not old.exists()  # the old entry went, this run's own stays
    (entry,) = cache_entries(cache)
    assert entry.checkpoint == str(ckpt.resolve()) and entry.size == du(entry.directory)
    # the estimate against the files written: within 5% + 4 kB (the manifest, the headers, the rounding)
    estimate = parse_size(estimate_line("\n".join(err)).split("about ")[1].split(" under ")[0])
    assert abs(entry.size - estimate) <= 0.05 * estimate + 4096, (entry.size, estimate)
    assert any(ln.startswith("cache: removed the 1 cache entry least recently used") for ln in err)


def test_cli_refuses_a_bad_limit_in_one_line(capsys, ckpt, tmp_path):
    argv = ["entropy", "--ckpt", str(ckpt), "--data", str(tmp_path / "x.txt"), "--cache-limit", "lots"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected a size such as 5GB, 500MB or 0, got 'lots'" in err[0]


def test_default_cache_is_the_users_own(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache() == str(tmp_path / "xdg" / "lime-probe")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache() == str(tmp_path / "home" / ".cache" / "lime-probe")
    assert cli.main(["cache", "--help"]) == 0
    assert "yours alone: under $XDG_CACHE_HOME, else ~/.cache" in " ".join(capsys.readouterr().out.split())


# --------------------------------------------------------------------------- what killed runs leave


def test_stale_staging_is_removed_only_when_its_owner_is_gone(tmp_path):
    out = tmp_path / "out"
    live = tmp_path / f"{staging_prefix(out)}live1234.partial"  # this process: running
    dead = tmp_path / f".out.{dead_pid()}@{owner_tag().split('@')[1]}.dead1234.partial"
    elsewhere = tmp_path / f".out.{dead_pid()}@another-host.xyz12345.partial"  # cannot be checked from here
    other_out = tmp_path / f".results.{dead_pid()}@{owner_tag().split('@')[1]}.abcd1234.partial"
    legacy = tmp_path / ".out.k2j3h4.partial"  # no owner in the name: not ours to judge
    for folder in (live, dead, elsewhere, other_out, legacy):
        folder.mkdir()
        (folder / "x.json").write_text("{}")
    with staged_output(out) as tmp:
        assert tmp.name.startswith(staging_prefix(out)) and tmp.name.endswith(".partial")
        (tmp / "r.json").write_text("1")
    assert (out / "r.json").read_text() == "1"
    assert not dead.exists() and not other_out.exists()
    assert live.is_dir() and elsewhere.is_dir() and legacy.is_dir()


KILLED_STAGING = """
import os, signal, sys
from lime_probe.output.staging import staged_output
with staged_output(sys.argv[1]) as tmp:
    (tmp / "half.json").write_text("{")
    os.kill(os.getpid(), signal.SIGKILL)
"""

KILLED_WRITER = """
import os, signal, sys
from lime_probe.extraction.cache import ShardCache
from lime_model.files import atomic_path
cache = ShardCache(sys.argv[1], {"run": "killed"}, prefix="llama")
with atomic_path(cache.directory / "shard-00000.safetensors") as tmp:
    tmp.write_bytes(b"\\0" * 3000)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def run_killed(script: str, *args: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], check=False)
    assert proc.returncode == -signal.SIGKILL


def test_a_sigkilled_command_leaves_staging_that_the_next_run_removes(tmp_path):
    out = tmp_path / "out"
    run_killed(KILLED_STAGING, out)
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".out.") and (left / "half.json").is_file()
    with staged_output(out) as tmp:
        (tmp / "ok.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_sigkilled_writer_leaves_a_temp_file_that_cache_removes(tmp_path):
    cache = tmp_path / "cache"
    run_killed(KILLED_WRITER, cache)
    (entry,) = cache.iterdir()
    assert len(list(entry.glob(".*.tmp"))) == 1 and du(entry) >= 3000  # the killed writer's temp file
    busy = fake_entry(cache, "2", 700, 1)  # an entry this (live) process writes: its temp file stays
    (busy / (WRITER + owner_tag())).touch()
    (busy / ".shard-00001.safetensors.abc.tmp").write_bytes(b"\0" * 500)
    text = cache_report(cache)
    assert not list(entry.glob(".*.tmp")) and not list(entry.glob(WRITER + "*"))
    assert (busy / ".shard-00001.safetensors.abc.tmp").is_file()
    assert cache_size(cache) == du(cache) == du(entry) + du(busy)  # the stale temp file no longer counted
    assert "(being written)" in text and f"{format_size(du(cache))}  total in 2 entries" in text
    stale_free = du(entry)
    assert cache_report(cache, clear=True, yes=True) == (
        f"removed 1 cache entry ({format_size(stale_free)}) from {cache}; {format_size(du(busy))} left "
        "(1 cache entry being written by a running process kept)"
    )
    assert not entry.exists() and busy.is_dir()
