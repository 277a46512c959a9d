"""Shared test settings.

The shared data (BLiMP, WikiText-2) is found only through the LIME_PROBE_DATA setting that
`.ci/run` provides; tests that need it skip with a reason where it is absent.
"""

import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch

# Tiny models: one thread is fastest and keeps the suite steady on a loaded 2-core machine.
torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """The whole suite run without naming tests (``./dev test``) is its quick tier: the tests marked ``slow``
    (over ~5 s: trainings, studies, notebooks, subprocesses that load torch) are left out, so the run fits
    20 minutes on a quiet 2-core machine; ``-m slow`` runs them alone (`.ci/run` runs both tiers), and any
    ``-m`` or named files or tests run as asked. The 15 slowest tests are listed at the end, so a test that
    grows past the tier's budget shows."""
    if not config.option.markexpr and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.option.markexpr = "not slow"
    if config.option.durations is None:
        config.option.durations = 15


@pytest.fixture(scope="session")
def shared_data() -> Path:
    root = os.environ.get("LIME_PROBE_DATA")
    if not root or not Path(root).is_dir():
        pytest.skip(
            "shared data not available: set LIME_PROBE_DATA to the folder holding blimp/ and wikitext-2/"
        )
    return Path(root)


@pytest.fixture
def text(tmp_path, monkeypatch) -> Path:
    """A small training text (80 short documents); lime-model's cache goes under ``tmp_path``."""
    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "t.txt"
    path.write_text("\n\n".join(f"document {i} says the cat sat on mat number {i % 13}" for i in range(80)))
    return path


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny LLaMA, LIMe and BERT checkpoints for the command-line tests (tests/test_cli*.py), built once."""
    from helpers import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("ckpts")
    return {arch: save_tiny_checkpoint(root / arch, arch) for arch in ("llama", "lime", "bert")}


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """`helpers.DOCS` as one text file, documents separated by blank lines: the command-line tests' data."""
    from helpers import DOCS

    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n\n".join(DOCS) + "\n")
    return path


@functools.cache
def _why_no_triton_interpreter() -> str | None:
    """Why Triton's interpreter cannot run ``lime_model.kv_kernels``' kernel here, or None where it can: the
    kernel loops over a scalar argument, which Triton 3.6's interpreter fails on with NumPy 2.4."""
    if importlib.util.find_spec("triton") is None:
        return "the Triton kernel's tests need Triton (the dev extra)"
    import triton
    import triton.language as tl

    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # triton.jit reads it when it decorates
    try:

        @triton.jit
        def count(out, n):
            for i in range(n):
                tl.store(out + i, i + 1.0)

        out = torch.zeros(3)
        count[(1,)](out, 2)
        assert out.tolist() == [1.0, 2.0, 0.0], out
    except Exception as err:
        return f"Triton {triton.__version__}'s interpreter cannot loop over a scalar argument here ({err!r:.120})"
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return None


@pytest.fixture
def triton_interpreter(monkeypatch) -> None:
    """Triton's interpreter on (``TRITON_INTERPRET=1``: kernels run on CPU tensors); skips, saying why, where
    Triton is missing or its interpreter cannot run the kernel."""
    reason = _why_no_triton_interpreter()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
