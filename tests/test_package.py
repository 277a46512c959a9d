"""The package's public names resolve, and the documented quick start works on a tiny checkpoint."""

import torch
from helpers import save_tiny_checkpoint

import lime_probe


def test_every_export_resolves():
    for name in lime_probe.__all__:
        assert getattr(lime_probe, name) is not None, name


def test_quick_start_from_the_docstring(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    model, tok = lime_probe.load(str(ckpt))
    texts = ["the cat is here", "dogs are there and were here"]
    acts = lime_probe.extract(model, tok, texts, sites=["values", "hidden"], progress=False)
    n_tokens = sum(len(tok(t)["input_ids"]) for t in texts)
    values = acts["values"][0]
    assert values.shape[0] == n_tokens
    # matrix entropy of one sequence's values against the formula on its Gram matrix
    Z = acts.sequences("values", 0)[0].double()
    p = torch.linalg.eigvalsh(Z @ Z.T).clamp(min=0)
    p = p / p.sum()
    expected = -(p[p > 0] * p[p > 0].log()).sum()
    assert torch.allclose(lime_probe.matrix_entropy(Z, alpha=1.0), expected, atol=1e-8)


def test_every_exact_pin_of_the_setup_satisfies_the_librarys_own_range():
    """constraints.txt pins what ./dev installs; pyproject.toml states what the library needs. A floor
    raised above a pin (or a pin outside a range) would install a set the library refuses."""
    from pathlib import Path

    import pytest
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

    root = Path(__file__).resolve().parents[1]
    pins = {}
    for line in (root / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project.get("optional-dependencies", {}).values() for r in extra]
    checked = 0
    for req in reqs:
        pin = pins.get(req.name.lower())
        if pin is not None:
            assert req.specifier.contains(pin, prereleases=True), f"{req.name}=={pin} outside {req.specifier}"
            checked += 1
    assert checked >= 5 and {"torch", "transformers", "accelerate"} <= set(pins)
