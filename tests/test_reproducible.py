"""The reproducible mode: the same seed gives the same bits whatever instruction sets the libraries would pick.

One machine cannot be two CPUs, but it can cap the instruction sets MKL, oneDNN and PyTorch's kernels
choose (the variables the mode pins): a training under capped sets is a run on an older machine's code
paths. Without the mode the capped run's weights differ from the native one's (so the test can fail);
in the mode both equal bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_TRAIN

from lime_model import reproducible
from lime_model.cli import main as model_main

ROOT = Path(__file__).resolve().parent.parent
# an older CPU's code paths on this one: SSE4.1 for oneDNN, MKL's SSE2 branch, PyTorch's unvectorised kernels
CAPPED = {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any of the mode's variables, plus ``extra``."""
    drop = set(reproducible.PINNED) | {"LIME_REPRODUCIBLE"}
    return {k: v for k, v in os.environ.items() if k not in drop} | {"OMP_NUM_THREADS": "1"} | extra


def train(out: Path, text: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    """``lime-model train`` of the tiny model for 5 steps in a new process (as a user starts it)."""
    argv = ["train", "--recipe", "cpu-tiny", "--out", str(out), "--data", str(text), "--steps", "5"]
    return subprocess.run(
        [sys.executable, "-m", "lime_model.cli", *argv, *TINY_TRAIN, *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def weights_digest(run: Path) -> str:
    return hashlib.sha256((run / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.slow
def test_capped_instruction_sets_change_the_bits_without_the_mode_and_not_in_it(tmp_path, text):
    runs = {}
    for mode in ("off", "on"):
        for isa, env in (("native", clean_env()), ("capped", clean_env(**CAPPED))):
            out = tmp_path / f"{mode}-{isa}"
            done = train(out, text, env | {"LIME_MODEL_CACHE": str(tmp_path / "cache")},
                         *(["--reproducible"] if mode == "on" else []))  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            runs[mode, isa] = out
    assert weights_digest(runs["off", "native"]) != weights_digest(runs["off", "capped"])
    assert weights_digest(runs["on", "native"]) == weights_digest(runs["on", "capped"])

    # what each run recorded: the mode's pins in effect, or the capped settings it ran under
    on = json.loads((runs["on", "capped"] / "run_info.json").read_text())[-1]["reproducible"]
    assert on == {
        "reproducible": True,
        "env": reproducible.PINNED,
        "processor": reproducible.processor(),
        "cpu_capability": "AVX2",
        "torch_threads": 1,
        "deterministic_algorithms": True,
    }
    off = json.loads((runs["off", "capped"] / "run_info.json").read_text())[-1]["reproducible"]
    assert off["reproducible"] is False and off["cpu_capability"] == "DEFAULT"
    assert {k: off["env"][k] for k in CAPPED} == CAPPED
    assert (
        reproducible.run_mode(runs["on", "native"]) is True
        and reproducible.run_mode(runs["off", "native"]) is False
    )
    assert "reproducible mode: on (MKL_CBWR=AVX2,STRICT" in (runs["on", "native"] / "README.md").read_text()
    assert (
        "reproducible mode: off (torch CPU capability DEFAULT"
        in (runs["off", "capped"] / "README.md").read_text()
    )

    # a run continues only in the mode it started in (this test process is not in the mode)
    for args in (["--steps", "6", "--resume"],):
        code = model_main(["train", "--recipe", "cpu-tiny", "--out", str(runs["on", "native"]), "--data", str(text),
                           *TINY_TRAIN, *args])  # fmt: skip
        assert code == 2


def test_a_run_is_continued_or_reused_only_in_its_own_mode(tmp_path):
    run = tmp_path / "run"
    assert reproducible.run_mode(run) is None  # no run: nothing to refuse
    reproducible.check_same_mode(run, True)
    run.mkdir()
    (run / "run_info.json").write_text(json.dumps([{"torch": "2.13.0"}]))  # trained before the mode existed
    assert reproducible.run_mode(run) is False
    reproducible.check_same_mode(run, False)
    with pytest.raises(
        ValueError, match="trained without the reproducible mode, this process runs in"
    ) as err:
        reproducible.check_same_mode(run, True)
    assert "\n" not in str(err.value)
    on = {"reproducible": {"reproducible": True}}
    (run / "run_info.json").write_text(json.dumps([on, on]))
    assert reproducible.run_mode(run) is True
    (run / "run_info.json").write_text(json.dumps([on, {"reproducible": {"reproducible": False}}]))
    assert reproducible.run_mode(run) is False  # one start outside the mode: the run is not the mode's


def test_the_mode_cannot_be_entered_after_torch_loaded_without_it(monkeypatch):
    import torch  # noqa: F401  (loaded by this test process without the mode's variables)

    for k in reproducible.PINNED:
        monkeypatch.delenv(k, raising=False)
    reproducible.pin()  # too late to pin: it leaves the environment to enable's refusal
    assert not set(reproducible.PINNED) & set(os.environ)
    with pytest.raises(reproducible.ModeError, match="torch was imported before it could set MKL_CBWR"):
        reproducible.enable()
    assert not reproducible.active()
    # NumPy alone loaded: its openBLAS has read its core type already
    monkeypatch.delitem(sys.modules, "torch")
    with pytest.raises(reproducible.ModeError, match="numpy was imported before .*OPENBLAS_CORETYPE=Haswell"):
        reproducible.enable()


def test_in_the_mode_openblas_runs_its_haswell_kernels_and_mkl_its_avx2_branch():
    """In a new process in the mode: the pin set, NumPy's and SciPy's openBLAS on their Haswell core and
    one thread (threadpoolctl reads what each loaded library runs; without the pin an AVX-512 machine's
    is SkylakeX), and MKL's verbose log the branch of its GEMM: AVX2 on an Intel processor, its own choice
    (CNR:AUTO) on any other, where MKL ignores the pin."""
    pytest.importorskip("threadpoolctl", reason="threadpoolctl (scikit-learn's) reads openBLAS's core")
    code = (
        "import json, os, lime_model, numpy, scipy.linalg, torch, threadpoolctl;"
        "a = torch.ones(64, 64, dtype=torch.float64); a @ a;"
        "print(json.dumps([os.environ.get('OPENBLAS_CORETYPE'), [[i['architecture'], i['num_threads']]"
        " for i in threadpoolctl.threadpool_info() if i['internal_api'] == 'openblas']]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                          env=clean_env(LIME_REPRODUCIBLE="1", MKL_VERBOSE="1"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-1000:]
    log, _, printed = done.stdout.strip().rpartition("\n")
    pinned, cores = json.loads(printed)
    assert pinned == "Haswell"
    assert all(core == ["Haswell", 1] for core in cores), cores  # none: a NumPy built on another BLAS
    if not reproducible.processor() or "MKL_VERBOSE" not in log:
        assert cores, "neither an openBLAS nor MKL's log to check"
        return
    intel = "GenuineIntel" in reproducible.processor()
    gemm = next(line for line in log.splitlines() if "DGEMM" in line)
    assert f"CNR:{'AVX2,STRICT' if intel else 'AUTO'} " in gemm, gemm


def test_a_library_user_enters_the_mode_through_the_environment():
    """``LIME_REPRODUCIBLE=1`` before Python starts: ``import lime_model`` pins the libraries first."""
    code = "import lime_model, torch; from lime_model.reproducible import active; print(active(), torch.get_num_threads())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(LIME_REPRODUCIBLE="1"),
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == ["True", "1"], done.stderr[-1000:]


def test_which_mode_each_command_runs_in():
    from lime_probe import cli
    from lime_probe.studies.catalog import BEFORE_THE_MODE, ON_GPUS, STUDIES

    parse = cli.build_parser().parse_args
    assert cli._reproducible(parse(["demo"])) is True
    assert cli._reproducible(parse(["demo", "--no-reproducible"])) is False
    for name, study in STUDIES.items():  # a study's own mode: off for runs trained before it or on GPUs
        off = name in BEFORE_THE_MODE or name in ON_GPUS
        assert cli._reproducible(parse(["reproduce", "--study", name])) is not off
        assert study.reproducible is not off
    assert cli._reproducible(parse(["reproduce", "--study", "lm-cpu-fair", "--reproducible"])) is True
    assert STUDIES["arithmetic-dose-response"].reproducible  # declared after the mode: runs in it
    assert cli._reproducible(parse(["entropy", "--ckpt", "x", "--data", "y"])) is None  # no training: no flag
