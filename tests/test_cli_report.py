"""`lime-probe report` end to end: a self-contained page whose sections equal the commands' results,
each analysis with its own defaults, and a skipped section exit 3 unless allowed."""

from __future__ import annotations

import pytest
from helpers import read_json, run_cli, run_cli_ok

from lime_probe import cli
from lime_probe.specs import ANALYSES
from lime_probe.specs.reporting import REPORTABLE


@pytest.mark.slow  # ~11 s under load: every analysis twice
def test_report_is_self_contained_and_matches_the_commands(capsys, tmp_path, ckpts, text_file):
    common = [
        "--ckpt",
        ckpts["lime"],
        "--ckpt",
        ckpts["llama"],
        "--data",
        text_file,
        "--max-length",
        32,
        "--no-cache",
        "--num-windows",
        2,
    ]
    run_cli_ok(capsys, "report", *common, "--analyses", "entropy", "router", "--out", tmp_path / "r")
    run_cli_ok(capsys, "entropy", *common, "--out", tmp_path / "e")
    html = (tmp_path / "r" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3  # entropy + router per layer + router per head
    assert "<script" not in html and "Matrix entropy of values" in html and "Router weights" in html
    assert (
        read_json(tmp_path / "r" / "entropy_values.json")["rows"]
        == read_json(tmp_path / "e" / "entropy_values.json")["rows"]
    )
    assert {r["model"] for r in read_json(tmp_path / "r" / "router.json")["rows"]} == {"lime"}  # LIMe only


def test_report_options_left_out_keep_each_analysis_default():
    """report reads each analysis's defaults from its Spec: options left out give every analysis the
    parameters (and --max-sequences) its own command has by default."""
    args = cli.build_parser().parse_args(["report", "--ckpt", "x", "--data", "t.txt"])
    assert args.max_sequences is None
    for name in [*REPORTABLE, *cli.REPORT_JOINED]:  # BLiMP too: its layers the paper's range
        assert cli.params_of(ANALYSES[name], args) == ANALYSES[name].params(), name
    assert "layers" not in vars(args) and cli.extraction_of(args).layers is None  # extraction: all
    layered = cli.build_parser().parse_args(["report", "--ckpt", "x", "--data", "t.txt", "--layers", "2,3"])
    assert cli.params_of(ANALYSES["blimp"], layered).layers == "2,3"
    given = cli.build_parser().parse_args(["report", "--ckpt", "x", "--data", "t.txt", "--site", "keys"])
    assert {cli.params_of(ANALYSES[n], given).site for n in ("entropy", "cka", "tsne")} == {"keys"}


@pytest.mark.slow
def test_report_with_a_skipped_section_exits_3_unless_allowed(capsys, tmp_path, ckpts, text_file):
    common = ["--ckpt", ckpts["llama"], "--data", text_file, "--max-length", 32, "--no-cache"]
    common += ["--num-windows", 2, "--window", 16, "--analyses", "entropy", "cka", "separability"]
    common += ["--words", " is", " the"]
    argv = ["report", *common, "--max-sequences", 2, "--out", tmp_path / "r"]
    code, _, err = run_cli(capsys, *argv)
    last = err.strip().splitlines()[-1]
    assert code == 3, err
    assert last.startswith("lime-probe report: incomplete: 1 of 3 sections skipped (separability: ")
    assert "too rare" in last and "--allow-skips" in last
    html = (tmp_path / "r" / "report.html").read_text()  # written: the sections that worked, the skip listed
    assert "Skipped sections" in html and "Matrix entropy" in html
    code, _, err = run_cli(capsys, *argv[:-1], tmp_path / "r2", "--allow-skips")
    assert code == 0 and "skipped separability" in err and "incomplete" not in err
    # the cka section ran with cka's own default site (hidden), as `lime-probe cka` does
    run_cli_ok(capsys, "cka", *common[:7], "--max-sequences", 2, "--out", tmp_path / "c")
    assert (
        read_json(tmp_path / "r2" / "cka_hidden.json")["rows"]
        == read_json(tmp_path / "c" / "cka_hidden.json")["rows"]
    )
