"""`lime-probe training-curves` and `arithmetic-accuracy`: run folders' trainer logs tabulated as written."""

from __future__ import annotations

import json

from helpers import read_json, run_cli, run_cli_ok


def test_run_folder_analyses_read_the_trainer_logs(capsys, tmp_path):
    """training-curves and arithmetic-accuracy tabulate metrics.jsonl / arithmetic_eval.json as written."""
    runs = {}
    for label, offset in (("a", 0.0), ("b", 0.5)):
        run = runs[label] = tmp_path / label
        run.mkdir()
        records = [
            {"step": s, "tokens": 64 * s, "flops": 1e6 * s, "loss": 4.0 / s + offset} for s in (1, 2, 3)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
        (run / "arithmetic_eval.json").write_text(json.dumps({"accuracy": {"2": 0.9 - offset, "3": 0.4}}))
    ckpts = [x for run in runs.values() for x in ("--ckpt", run)]
    run_cli_ok(capsys, "training-curves", *ckpts, "--smooth", 2, "--out", tmp_path / "c")
    rows = read_json(tmp_path / "c" / "training_curves.json")["rows"]
    assert [(r["model"], r["step"], r["loss"]) for r in rows] == [
        (m, s, 4.0 / s + off) for m, off in (("a", 0.0), ("b", 0.5)) for s in (1, 2, 3)
    ]
    assert (tmp_path / "c" / "training_curves.png").is_file()
    run_cli_ok(
        capsys, "arithmetic-accuracy", *ckpts, "--label", "A", "--label", "B", "--out", tmp_path / "acc"
    )
    rows = read_json(tmp_path / "acc" / "arithmetic_accuracy.json")["rows"]
    assert {(r["model"], r["n_operators"]): r["accuracy"] for r in rows} == {
        ("A", 2): 0.9,
        ("A", 3): 0.4,
        ("B", 2): 0.4,
        ("B", 3): 0.4,
    }
    (runs["b"] / "arithmetic_eval.json").unlink()
    code, _, err = run_cli(capsys, "arithmetic-accuracy", *ckpts, "--out", tmp_path / "none")
    assert code == 2 and "no arithmetic_eval.json" in err and not (tmp_path / "none").exists()
