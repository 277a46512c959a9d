"""Shared test settings.

The shared data (BLiMP, WikiText-2) is found only through the LIME_PROBE_DATA setting that
`.ci/run` provides; tests that need it skip with a reason where it is absent.
"""

import os
from pathlib import Path

import pytest
import torch

# Tiny models: one thread is fastest and keeps the suite steady on a loaded 2-core machine.
torch.set_num_threads(1)


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
