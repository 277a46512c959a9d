"""The settings dataclasses (`Loading`, `Extraction`): the command line builds them from the options it
generates from their fields, a library call gets ``extract``'s own defaults, and the notebooks the
command's."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from helpers import save_tiny_checkpoint

from lime_probe import cli
from lime_probe.extraction.cachedir import parse_size
from lime_probe.extraction.settings import Extraction, Loading, cli_defaults, command_settings, default_cache
from lime_probe.notebook import command_defaults
from lime_probe.specs import ANALYSES, load_checkpoints


def parse(*argv: str):
    return cli.build_parser().parse_args([str(a) for a in argv])


def test_the_command_lines_options_build_the_settings():
    args = parse(
        "entropy", "--ckpt", "x", "--data", "d", "--layers", "0,-1", "--max-length", "64", "--max-tokens",
        "100", "--batch-size", "3", "--no-cache", "--cache-limit", "2MB", "--allow-unknown-tokens",
        "--dtype", "bfloat16", "--revision", "step1", "--device", "cuda", "--verbose",
    )  # fmt: skip
    assert cli.extraction_of(args) == Extraction(
        layers=(0, -1),
        max_length=64,
        max_tokens=100,
        batch_size=3,
        cache_dir=None,
        cache_limit=2 * 10**6,
        allow_unknown_tokens=True,
    )
    assert cli.loading_of(args) == Loading(dtype="bfloat16", revision=("step1",), device="cuda", verbose=True)
    # an analysis that reads --layers itself (BLiMP's 'paper') extracts every layer
    blimp = parse("blimp", "--ckpt", "x", "--layers", "paper")
    assert blimp.layers == "paper" and cli.extraction_of(blimp, own_layers=True).layers is None


def required(name: str) -> list[str]:
    """The options ``lime-probe NAME`` needs besides --ckpt."""
    kind = cli.DATA_KINDS[ANALYSES[name].data_kind]
    return [kind.flag, "d"] if (kind.option or {}).get("required") else []


def test_the_commands_defaults_are_the_dataclasses_cli_defaults():
    args = parse("entropy", "--ckpt", "x", "--data", "d")
    want = Extraction(max_length=256, cache_dir=default_cache(), cache_limit=parse_size("5GB"))
    assert cli.extraction_of(args) == want == command_settings(Extraction)
    assert cli.loading_of(args) == Loading() == command_settings(Loading)
    assert (args.layers, args.cache, args.cache_limit) == ("all", default_cache(), 5 * 10**9)  # as recorded
    options = {
        "dtype",
        "device_map",
        "revision",
        "device",
        "verbose",
        "max_length",
        "max_tokens",
        "batch_size",
    }
    options |= {"cache", "cache_limit", "allow_unknown_tokens"}
    for name, spec in ANALYSES.items():  # every command that loads models has every settings option
        if spec.data_kind == "none":
            continue
        parsed = vars(parse(name, "--ckpt", "x", *required(name)))
        defaults = cli_defaults(Loading) | cli_defaults(Extraction)
        assert {k: parsed[k] for k in options} == {k: defaults[k] for k in options}, name


def test_a_library_call_extracts_as_extract_does():
    """`Extraction()` (what ``Spec.run`` uses when given none) holds ``extract``'s own defaults, and every
    setting it passes is a keyword of ``extract``."""
    from lime_probe.extraction.tracing import extract

    params = inspect.signature(extract).parameters
    kwargs = Extraction().extract_kwargs()
    assert set(kwargs) <= set(params)
    assert {k: params[k].default for k in kwargs} == kwargs
    assert Extraction(layers=(0, 2)).extract_kwargs()["layers"] == [0, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Extraction().max_length = 1  # type: ignore[misc]


def test_device_and_device_map_together_are_refused():
    with pytest.raises(ValueError, match="give --device or --device-map, not both"):
        Loading(device="cuda", device_map="auto")
    assert Loading(device_map="auto").device_map == "auto"  # the default device is no choice


def test_a_device_name_loads_as_loading_on_that_device(tmp_path):
    ckpt = str(save_tiny_checkpoint(tmp_path / "m", "llama"))
    (named,) = load_checkpoints([ckpt], ["m"], "cpu")
    (declared,) = load_checkpoints([ckpt], ["m"], Loading(dtype="bfloat16"))
    assert str(next(named.model._module.parameters()).dtype) == "torch.float32"  # the checkpoint's own
    assert str(next(declared.model._module.parameters()).dtype) == "torch.bfloat16"
    with pytest.raises(ValueError, match="no --ckpt is a hub id"):
        load_checkpoints([ckpt], ["m"], Loading(revision=("step1",)))


def test_notebook_defaults_are_the_commands_settings():
    for name, spec in ANALYSES.items():
        defaults = command_defaults(name)
        params = dataclasses.asdict(spec.params())
        assert {k: defaults[k] for k in params} == params, name
        if spec.data_kind != "none":
            extraction = cli.extraction_of(parse(name, "--ckpt", "x", *required(name)), "layers" in params)
            assert defaults["max_length"] == extraction.max_length == 256, name
            assert defaults["device"] == "cpu" and defaults["max_tokens"] is None, name
