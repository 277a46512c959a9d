"""``lime-model train --report-to``: accelerate's trackers log what ``metrics.jsonl`` holds.

TensorBoard runs offline: its event files, read back with TensorBoard's own reader, hold every logged
number of every step. W&B needs an account and the network, so here only its refusal when the package
is missing is checked; with wandb installed the option goes to accelerate (``log_with="wandb"``) as is.
"""

from __future__ import annotations

import json

import pytest
from helpers import train_args

from lime_model import cli
from lime_model import train as T


def test_tensorboard_event_files_hold_the_metrics(tmp_path, text):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (pip install 'lime-probe[tracking]')",
    )
    out = tmp_path / "run"
    extra = ["--report-to", "tensorboard", "--set", "eval_holdout=0.1"]
    assert cli.main(train_args(out, text, *extra, steps=3)) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3] and "val_loss" in logged[-1]

    acc = event_accumulator.EventAccumulator(
        str(out / "tensorboard" / "lime-model"), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()  # the folder's own event files: the scalars (add_hparams writes to a subfolder)
    names = set(acc.Tags()["scalars"])
    assert names == {k for r in logged for k in r} - {"step"}
    for name in names:
        expected = [(r["step"], r[name]) for r in logged if name in r]
        got = [(e.step, e.value) for e in acc.Scalars(name)]
        assert [s for s, _ in got] == [s for s, _ in expected], name
        for (_, v), (_, want) in zip(got, expected, strict=True):  # stored as float32
            assert v == pytest.approx(want, rel=1e-6), name


def test_no_tracker_by_default(tmp_path, text):
    out = tmp_path / "run"
    assert cli.main(train_args(out, text, steps=1)) == 0
    assert not (out / "tensorboard").exists()


def test_tracker_options():
    assert T.tracker_options("none", T.Path("r")) == {}
    with pytest.raises(ValueError, match="report_to must be one of none, tensorboard, wandb"):
        T.tracker_options("mlflow", T.Path("r"))


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_refused_before_training(tracker, tmp_path, text, monkeypatch, capsys):
    """accelerate would skip an unavailable tracker silently; ``train`` says what to install instead."""
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, f"is_{tracker}_available", lambda: False)
    assert cli.main(train_args(tmp_path / "run", text, "--report-to", tracker)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--report-to {tracker} needs the {tracker} package" in err, err
    assert not (tmp_path / "run").exists()
