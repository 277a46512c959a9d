"""`lime_probe.specs.inputs.check_request` called as a script calls it, with typed values: each refusal
names its problem before any model loads, in the order the command line checks them."""

from __future__ import annotations

import pytest
from helpers import save_tiny_checkpoint

from lime_probe.specs import ANALYSES
from lime_probe.specs.inputs import check_request
from lime_probe.specs.perplexity import PerplexityParams


def test_a_request_without_problems_passes_and_builds_each_parameter_set_once(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path / "lime", "lime")
    built = []

    def params():
        for name in ("entropy", "cka"):
            built.append(name)
            yield name, ANALYSES[name].params()

    check_request(params(), checkpoints=[str(ckpt)], load=True, folders={"--out": str(tmp_path / "out")})
    assert built == ["entropy", "cka"] and not (tmp_path / "out").exists()  # checked, nothing made


def test_max_length_is_checked_against_each_analysis_in_order():
    need = ANALYSES["logit-lens"].min_length
    with pytest.raises(ValueError, match=f"--max-length 1: logit-lens needs at least {need} tokens"):
        check_request([("entropy", ANALYSES["entropy"].params()), ("logit-lens", ANALYSES["logit-lens"].params())],
                      max_length=1)  # fmt: skip


def test_labels_come_first_and_a_window_is_checked_only_against_loaded_local_checkpoints(tmp_path):
    ckpt = str(save_tiny_checkpoint(tmp_path / "llama", "llama"))  # 128 positions
    too_long = [("perplexity", PerplexityParams(window=129))]
    with pytest.raises(ValueError, match="got 2 --label for 1 --ckpt"):
        check_request(too_long, checkpoints=[ckpt], labels=["a", "b"], load=True)
    check_request(too_long, checkpoints=[ckpt])  # not loaded as a model (router): its window is not read
    with pytest.raises(ValueError, match="--window 129 is longer than llama's 128 positions"):
        check_request(too_long, checkpoints=[ckpt], load=True)


def test_data_and_layers_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--layers must be 'all' or comma-separated integers, got 'x'"):
        check_request([], layers="x")
    with pytest.raises(FileNotFoundError, match="data not found"):
        check_request([], texts=str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match=r"--blimp .*no such file or folder"):
        check_request([], blimp=[("--blimp", str(tmp_path / "no-blimp"))])
