"""``bench/gpu_check.py --dry-run``: every section runs at toy size on the CPU and writes one JSON whose
numbers are what each section says they are."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import bench_script

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_check():
    return bench_script("gpu_check")


@pytest.mark.slow
def test_dry_run_runs_every_section_and_writes_sane_numbers(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = done.stdout.splitlines()[1:6]  # the sections and their budgets, printed first
    assert [line.split()[0] for line in plan] == ["step", "parity", "memory", "probes", "total"]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["settings"]["device"] == "cpu"
    sections = result["sections"]
    assert list(sections) == ["step", "parity", "memory", "probes"]
    for body in sections.values():
        assert "error" not in body
        assert 0 < body["seconds"] <= result["seconds"]

    step = sections["step"]
    assert step["skipped"] == []
    rows = {(r["shape"], r["variant"]): r for r in step["rows"]}
    assert set(rows) == {(s, v) for s in ("gqa", "mha") for v in ("full", "first-4", "last-4", "dilated-8")}
    for r in rows.values():
        assert r["step_s"] > 0 and r["llama_step_s"] > 0 and r["ratio"] > 0
        assert r["ci"][0] <= r["ratio"] <= r["ci"][1]

    parity = {r["model"]: r for r in sections["parity"]["rows"]}
    assert set(parity) == {"LIMe", "LLaMA"}
    for r in parity.values():
        errors = [r["logits_rel_error"], r["grad_rel_error_median"], r["grad_rel_error_max"]]
        assert all(math.isfinite(e) for e in errors)
        if result["settings"]["dtype"] == "bfloat16":  # bf16 rounds (2^-9 relative): errors small, not 0
            assert all(0 < e < 0.1 for e in errors)
            assert r["grad_rel_error_median"] <= r["grad_rel_error_max"]
        assert r["loss_abs_error"] < 0.05 * r["loss_fp32"]
    assert parity["LIMe"]["router_grad_rel_error_max"] is not None
    assert parity["LLaMA"]["router_grad_rel_error_max"] is None

    memory = sections["memory"]
    assert {(r["recipe"], r["model"]) for r in memory["rows"]} == {
        (f"lime-1b-{s}", m) for s in ("gqa", "mha") for m in ("LIMe", "LLaMA")
    }
    assert all(r["measured_bytes"] >= 0 for r in memory["rows"])
    assert all(r["planned_bytes"] > 0 for r in memory["rows"])

    probes = sections["probes"]
    for key in ("plain_forward_tokens_per_s", "extract_tokens_per_s", "entropy_tokens_per_s"):
        assert probes[key] > 0
    assert probes["extract_over_plain_time"] == pytest.approx(
        probes["plain_forward_tokens_per_s"] / probes["extract_tokens_per_s"]
    )
    assert len(probes["blimp_probe_accuracy"]) == probes["layers"]
    assert all(0 <= a <= 1 for a in probes["blimp_probe_accuracy"])
