"""Runs that must not lose or corrupt work: checkpoint digests checked on resume, one writer per run
directory, a full disk refused in one line naming the file."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import train_args
from safetensors.torch import load_file

from lime_model import checkpoint as C
from lime_model import train as T
from lime_model.cli import main
from lime_model.command_line import run_command
from lime_model.files import DiskFullError, atomic_dir, atomic_write

STEPS = ["--steps", "6", "--set", "save_every=2", "--set", "keep_last=3"]


def train_cli(out, text, *extra):
    """``lime-model train`` of the tiny model, 6 steps, a checkpoint every 2."""
    return main([*train_args(out, text, *extra), *STEPS])


def stderr_lines(capsys):
    return capsys.readouterr().err.strip().splitlines()


def ckpt(out, step):
    return out / "checkpoints" / f"step-{step:08d}"


def flip_64_bytes(path):
    """Invert 64 bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


def cut_short(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garble(path):
    path.write_bytes(b'{"step": 4, "tok')


def drop_digests(path):
    """A checkpoint written before digests were recorded."""
    state = json.loads(path.read_text())
    del state[C.DIGESTS]
    path.write_text(json.dumps(state))


def snapshot(folder):
    """Every file's bytes under ``folder`` but the lock file (which a refused start rewrites)."""
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.name != C.LOCK}


@pytest.fixture
def reference(tmp_path, text):
    """The final weights of the run trained without interruption."""
    out = tmp_path / "reference"
    assert train_cli(out, text) == 0
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize(
    ("file", "damage"),
    [
        ("model.safetensors", flip_64_bytes),
        ("model.safetensors", cut_short),
        (C.STATE_TENSORS, flip_64_bytes),
        (C.STATE_TENSORS, cut_short),
        (C.STATE_JSON, garble),
    ],
)
def test_a_corrupt_last_checkpoint_is_set_aside_and_the_previous_one_resumed(
    tmp_path, text, capsys, monkeypatch, reference, file, damage
):
    out = tmp_path / "run"
    assert train_cli(out, text, "--stop-after", "4") == 0
    intact = (ckpt(out, 2) / "model.safetensors").read_bytes()
    damage(ckpt(out, 4) / file)
    damaged = (ckpt(out, 4) / file).read_bytes()
    loaded = {}

    def spy(path, model):  # the weights the run continues from, as loaded
        loaded["from"] = path
        C.load_weights(path, model)
        loaded["weights"] = {k: v.clone() for k, v in model.state_dict().items()}

    monkeypatch.setattr(T, "load_weights", spy)
    capsys.readouterr()
    assert train_cli(out, text) == 0
    notices = [line for line in stderr_lines(capsys) if "is corrupt" in line]
    assert len(notices) == 1, notices
    assert str(ckpt(out, 4) / file) in notices[0] and "continuing from step-00000002" in notices[0]
    assert loaded["from"] == ckpt(out, 2)
    saved = load_file(ckpt(out, 2) / "model.safetensors")
    assert (ckpt(out, 2) / "model.safetensors").read_bytes() == intact
    assert all(torch.equal(loaded["weights"][k], v) for k, v in saved.items())
    # the damaged checkpoint is kept aside, untouched; the run ends exactly as the uninterrupted one
    assert (out / "checkpoints" / "corrupt-step-00000004" / file).read_bytes() == damaged
    metrics = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4, 5, 6]
    final = load_file(out / "model.safetensors")
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)
    assert not list(out.rglob(".*.tmp"))


@pytest.mark.parametrize(
    ("file", "damage"),
    [("model.safetensors", flip_64_bytes), (C.STATE_JSON, garble)],
)
def test_no_intact_checkpoint_is_one_line_and_exit_2_and_the_advice_works(
    tmp_path, text, capsys, file, damage
):
    out = tmp_path / "run"
    assert train_cli(out, text, "--stop-after", "2") == 0
    damage(ckpt(out, 2) / file)
    before = snapshot(out)
    capsys.readouterr()
    started = time.perf_counter()
    assert train_cli(out, text) == 2
    assert time.perf_counter() - started < 5  # refused before any training
    (line,) = stderr_lines(capsys)
    assert line.startswith("lime-model: error: ") and str(ckpt(out, 2) / file) in line
    assert "no earlier checkpoint is intact" in line and f"delete {out / 'checkpoints'}" in line
    assert snapshot(out) == before  # nothing moved or written
    # as the line says: without the checkpoints the same command trains the run again from step 0
    for f in ckpt(out, 2).iterdir():
        f.unlink()
    ckpt(out, 2).rmdir()
    assert train_cli(out, text) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]


def test_digests_are_recorded_and_checkpoints_from_before_them_still_checked(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert train_cli(out, text, "--stop-after", "4") == 0
    state = json.loads((ckpt(out, 4) / C.STATE_JSON).read_text())
    files = {f.name for f in ckpt(out, 4).iterdir()} - {C.STATE_JSON}
    assert set(state[C.DIGESTS]) == files and {"model.safetensors", C.STATE_TENSORS} <= files
    assert C.damage(ckpt(out, 4)) is None
    drop_digests(ckpt(out, 4) / C.STATE_JSON)
    assert C.damage(ckpt(out, 4)) is None  # an old checkpoint: its headers are checked instead
    cut_short(ckpt(out, 4) / C.STATE_TENSORS)
    assert str(ckpt(out, 4) / C.STATE_TENSORS) in C.damage(ckpt(out, 4))


def test_a_second_train_into_a_held_run_is_refused_naming_the_holder(tmp_path, text, capsys):
    out = tmp_path / "run"
    assert train_cli(out, text, "--stop-after", "2") == 0
    holder = C.RunLock()
    holder.take(out, out)  # as another `lime-model train` holds it
    before = snapshot(out)
    capsys.readouterr()
    try:
        assert train_cli(out, text) == 2
    finally:
        holder.release()
    (line,) = stderr_lines(capsys)
    assert line.startswith("lime-model: error: ") and "in use by another lime-model train" in line
    assert f"pid {os.getpid()} on " in line
    assert snapshot(out) == before
    assert train_cli(out, text) == 0  # released: the run continues


def test_a_killed_holder_does_not_block_the_run(tmp_path, text):
    out = tmp_path / "run"
    assert train_cli(out, text, "--stop-after", "2") == 0
    killed = subprocess.run(
        [sys.executable, "-c", "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid 1 on elsewhere'); os.kill(os.getpid(), signal.SIGKILL)",
         str(out / C.LOCK)],
    )  # fmt: skip
    assert killed.returncode == -9
    assert train_cli(out, text) == 0
    assert (out / "model.safetensors").is_file()


def test_a_new_run_that_finds_another_run_published_first_is_refused(tmp_path, text, capsys, monkeypatch):
    out = tmp_path / "run"
    other = C.RunLock()
    prepare = T.prepare_data

    def meanwhile(*args, **kwargs):  # another run makes the same --out while this one tokenises
        out.mkdir()
        other.take(out, out)
        (out / "recipe.json").write_text("{}")
        return prepare(*args, **kwargs)

    monkeypatch.setattr(T, "prepare_data", meanwhile)
    capsys.readouterr()
    try:
        assert train_cli(out, text) == 2
    finally:
        other.release()
    (line,) = stderr_lines(capsys)
    assert "in use by another lime-model train" in line and f"pid {os.getpid()}" in line
    assert sorted(p.name for p in out.iterdir()) == sorted([C.LOCK, "recipe.json"])  # the other's, untouched
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run.")]  # no staging left


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_checkpointing_is_one_line_exit_2_and_the_run_continues_later(
    tmp_path, text, capsys, monkeypatch
):
    out = tmp_path / "run"

    def half_then_full(tensors, path):  # safetensors' own error, after part of the file is written
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")  # noqa: TRY002

    monkeypatch.setattr(C, "save_file", half_then_full)
    capsys.readouterr()
    assert train_cli(out, text) == 2
    (line,) = stderr_lines(capsys)
    assert (
        line == f"lime-model: error: {ckpt(out, 2)}: no space left on the disk (free some and run it again)"
    )
    assert not (out / "checkpoints").exists() or not list(
        (out / "checkpoints").iterdir()
    )  # nothing half-written
    assert not (out / "model.safetensors").exists()
    monkeypatch.undo()
    assert train_cli(out, text) == 0  # space freed: the same command finishes the run
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]


def test_a_full_disk_while_logging_metrics_names_the_file(tmp_path, text, capsys, monkeypatch):
    out = tmp_path / "run"

    class FullFile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        write = staticmethod(enospc)

    monkeypatch.setattr(T, "open", lambda *a, **k: FullFile(), raising=False)
    capsys.readouterr()
    assert train_cli(out, text) == 2
    (line,) = stderr_lines(capsys)
    assert (
        line
        == f"lime-model: error: {out / 'metrics.jsonl'}: no space left on the disk (free some and run it again)"
    )


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        OSError("4096 requested and 17 written"),  # numpy's short write
        Exception("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
    ],
)
def test_atomic_writes_name_the_destination_of_a_full_disk(tmp_path, error):
    path = tmp_path / "results.json"
    path.write_text("old")

    def write(f):
        f.write(b"part")
        raise error

    with pytest.raises(DiskFullError) as caught:
        atomic_write(path, write)
    assert caught.value.filename == str(path) and caught.value.errno == errno.ENOSPC
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    folder = tmp_path / "shards"
    with pytest.raises(DiskFullError) as caught, atomic_dir(folder) as tmp:
        atomic_write(tmp / "a.safetensors", write)  # named as the folder, not its temporary name
    assert caught.value.filename == str(folder) and not folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_other_write_errors_pass_unchanged(tmp_path):
    def write(f):
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "x", write)
    assert not isinstance(caught.value, DiskFullError) and caught.value.errno == errno.EIO


def test_a_full_disk_is_exit_2_in_both_programs(capsys):
    def work():
        raise DiskFullError(
            errno.ENOSPC, "no space left on the disk (free some and run it again)", "out/x.png"
        )

    assert run_command("lime-probe entropy", work, debug=False) == 2
    assert capsys.readouterr().err == (
        "lime-probe entropy: error: out/x.png: no space left on the disk (free some and run it again)\n"
    )


@pytest.mark.slow
def test_two_real_trains_into_one_out_the_second_refused_until_the_first_is_killed(tmp_path, text):
    """Real processes: a second `lime-model train` while the first trains; then the first SIGKILLed."""
    out = tmp_path / "run"
    root = Path(__file__).resolve().parent.parent
    argv = [sys.executable, "-m", "lime_model.cli", *train_args(out, text, "--set", "save_every=2", "--threads",
            "1", steps=5000)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while first.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    second = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=root, timeout=300)
    first.kill()
    first.communicate(timeout=60)
    assert second.returncode == 2 and second.stdout == ""
    (line,) = second.stderr.strip().splitlines()
    assert line.startswith("lime-model: error: ") and f"pid {first.pid} on " in line
    resumed = int(T.checkpoints(out)[-1].name[5:])
    again = subprocess.run([*argv, "--stop-after", str(resumed + 2)], capture_output=True, text=True, env=env,
                           cwd=root, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr  # the killed run's lock went with it
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, resumed + 3))  # no line twice, none out of order
