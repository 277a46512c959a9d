"""Studies as declarations, without training: endpoints read from hand-made rows, `compare` against
the paired t-test, Holm and BH written from their formulas (`plain_stats`), the catalog's declarations checked against the registry, the
perplexity analysis against lime-model's own evaluation and a hand loop, and bad input to the runner."""

import math

import numpy as np
import pytest
from plain_stats import bh_loop, holm_loop, paired_t

from lime_probe.extraction.settings import Extraction
from lime_probe.studies import STUDIES, Claim, Effect, Endpoint, Measure, Study, run_study
from lime_probe.studies.findings import compare

# --------------------------------------------------------------------------- Endpoint


def test_nested_mean_is_each_paradigms_mean_over_layers_then_the_mean_over_paradigms():
    rng = np.random.default_rng(0)
    # paradigms with different layer counts, so the nested mean differs from the flat one
    layers = {"a": [0, 1, 2], "b": [0, 1], "c": [0, 1, 2, 3]}
    rows = [
        {"paradigm": p, "layer": la, "site": s, "acc": float(rng.normal())}
        for p, ls in layers.items()
        for la in ls
        for s in ("values", "hidden")
    ]
    e = Endpoint("probe", "blimp", "acc", {"site": "values"}, over=("paradigm", "layer"))
    per_paradigm = []
    for p in layers:
        picked = [r["acc"] for r in rows if r["paradigm"] == p and r["site"] == "values"]
        per_paradigm.append(sum(picked) / len(picked))
    assert e.of(rows) == pytest.approx(sum(per_paradigm) / len(per_paradigm), abs=1e-12)
    flat = [r["acc"] for r in rows if r["site"] == "values"]
    assert abs(e.of(rows) - sum(flat) / len(flat)) > 1e-6  # the test tells nested from flat
    # per layer: each layer's mean over the paradigms that have it
    by_layer = e.per("layer", rows)
    assert sorted(by_layer) == [0, 1, 2, 3]
    for la, got in by_layer.items():
        vals = [r["acc"] for r in rows if r["layer"] == la and r["site"] == "values"]
        assert got == pytest.approx(sum(vals) / len(vals), abs=1e-12)


@pytest.mark.parametrize("layers", [[3, 0, 2, 1], [4, 0, 2, 1, 3], [7, 1, 5, 3, 9, 11, 13]])
def test_upper_half_keeps_the_upper_half_of_the_sorted_layers(layers):
    rows = [{"layer": la, "acc": float(10 * la + 1)} for la in layers]
    e = Endpoint("separability", "separability", "acc", over=("layer",), part="upper half")
    ordered = sorted(layers)
    upper = ordered[len(ordered) // 2 :]  # odd counts: the middle layer belongs to the upper half
    assert e.of(rows) == pytest.approx(sum(10 * la + 1 for la in upper) / len(upper))
    assert {r["layer"] for r in e.rows(rows)} == set(upper)


def test_largest_picks_the_largest_key_present():
    rows = [{"n_operators": k, "accuracy": k / 10} for k in (2, 5, 3)] + [{"other": 1, "accuracy": 9.0}]
    e = Endpoint("accuracy", "accuracy", "accuracy", {"n_operators": "largest"})
    assert e.of(rows) == 0.5
    assert e.of(rows[:1] + rows[2:3]) == 0.3  # whatever is present


def test_an_endpoint_without_a_matching_row_names_itself():
    e = Endpoint("value entropy", "entropy", "entropy_mean", {"site": "values"}, over=("layer",))
    with pytest.raises(ValueError, match="endpoint 'value entropy'.*entropy"):
        e.of([{"site": "hidden", "layer": 0, "entropy_mean": 1.0}])


# --------------------------------------------------------------------------- compare

SEEDS = (0, 1, 2, 3, 4)
LAYERS = (0, 1, 2, 3)
SCALAR = Endpoint("score", "score", "x")
LAYERED = Endpoint("spread", "layered", "y", {"site": "values"}, over=("layer",))


def hand_verdict(role, sign, lo, hi, mean):
    if role == "exploratory":
        return "exploratory"
    if not (lo > 0 or hi < 0):
        return "not resolved"
    if sign is None:
        return "higher" if mean > 0 else "lower"
    return "holds" if (mean > 0) == (sign > 0) else "reversed"


@pytest.fixture(scope="module")
def synthetic():
    """Four models over five seeds: A well above B, C well below, D about B; per-layer rows of two sites."""
    rng = np.random.default_rng(7)
    offset = {"A": 3.0, "B": 0.0, "C": -3.0}
    score, layered = {}, {}
    for m, off in offset.items():
        for s in SEEDS:
            score[m, s] = off + rng.normal(scale=0.5)
            for site in ("values", "hidden"):
                for la in LAYERS:
                    layered[m, s, site, la] = off * (la + 1) / 4 + rng.normal(scale=1.0)
    # D: B plus differences of both signs that nearly cancel (an unresolved difference by construction)
    for s, jitter in zip(SEEDS, (1.0, -1.0, 0.5, -0.5, 0.2), strict=True):
        score["D", s] = score["B", s] + jitter
        for site in ("values", "hidden"):
            for la in LAYERS:
                layered["D", s, site, la] = layered["B", s, site, la] + jitter * (la + 1)
    offset["D"] = 0.0
    measured = {
        "score": {(m, s): {"rows": [{"model": m, "x": score[m, s]}]} for m in offset for s in SEEDS},
        "layered": {
            (m, s): {
                "rows": [
                    {"model": m, "site": site, "layer": la, "y": layered[m, s, site, la]}
                    for site in ("values", "hidden")
                    for la in LAYERS
                ]
            }
            for m in offset
            for s in SEEDS
        },
    }
    claims = (
        Claim("A", "B", SCALAR, "primary", +1, "A above B"),  # holds
        Claim("C", "B", SCALAR, "primary", +1, "C above B"),  # reversed
        Claim("A", "B", LAYERED, "primary", None, "A differs"),  # higher
        Claim("C", "B", SCALAR, "secondary", None),  # lower
        Claim("D", "B", LAYERED, "secondary", +1),  # not resolved
        Claim(Effect("A-C", "A", "C"), Effect("D-B", "D", "B"), SCALAR, "secondary", +1),
        Claim("A", "B", LAYERED, "exploratory", per="layer"),
        Claim("D", "C", LAYERED, "exploratory", per="layer"),
    )
    study = Study(
        name="synthetic",
        question="?",
        recipe="none",
        models={m: {} for m in offset},
        seeds=SEEDS,
        measures={"score": Measure("perplexity"), "layered": Measure("entropy")},
        claims=claims,
    )
    values = {
        "score": lambda m, s: score[m, s],
        "layered": lambda m, s: np.mean([layered[m, s, "values", la] for la in LAYERS]),
    }
    per_layer = {la: (lambda m, s, la=la: layered[m, s, "values", la]) for la in LAYERS}
    return study, measured, compare(study, measured, SEEDS), values, per_layer


def test_each_comparison_is_the_paired_t_test_from_the_formula(synthetic):
    study, _, rows, values, _ = synthetic
    plain = [r for r in rows if r["role"] != "exploratory"]
    assert len(plain) == sum(c.role != "exploratory" for c in study.claims)
    for claim, row in zip([c for c in study.claims if c.per is None], plain, strict=True):
        if isinstance(claim.model, Effect):
            continue
        get = values[claim.endpoint.measure]
        a = [get(claim.model, s) for s in SEEDS]
        b = [get(claim.reference, s) for s in SEEDS]
        mean, lo, hi, p = paired_t(a, b)
        assert (row["model"], row["reference"], row["role"]) == (claim.model, claim.reference, claim.role)
        assert row["model_mean"] == pytest.approx(np.mean(a)) and row["reference_mean"] == pytest.approx(
            np.mean(b)
        )
        assert (row["diff_mean"], row["ci_low"], row["ci_high"]) == pytest.approx((mean, lo, hi), abs=1e-12)
        assert row["p_t"] == pytest.approx(p, rel=1e-9)
        assert row["per_seed_diff"] == pytest.approx(list(np.subtract(a, b)))
        assert row["n_seeds"] == len(SEEDS)
        assert row["verdict"] == hand_verdict(claim.role, claim.sign, lo, hi, mean)
    assert plain[2]["site"] == "values"  # a row names its endpoint's filter


def test_verdicts_cover_every_rule(synthetic):
    _, _, rows, _, _ = synthetic
    got = [r["verdict"] for r in rows if r["role"] != "exploratory"][:5]
    assert got == ["holds", "reversed", "higher", "lower", "not resolved"]


def test_an_effect_side_is_the_per_seed_difference_of_its_two_models(synthetic):
    _, _, rows, values, _ = synthetic
    row = next(r for r in rows if r["model"] == "A-C")
    x = values["score"]
    a = [x("A", s) - x("C", s) for s in SEEDS]
    b = [x("D", s) - x("B", s) for s in SEEDS]
    mean, lo, hi, p = paired_t(a, b)
    assert row["reference"] == "D-B"
    assert row["per_seed_diff"] == pytest.approx(
        [(x("A", s) - x("C", s)) - (x("D", s) - x("B", s)) for s in SEEDS]
    )
    assert (row["diff_mean"], row["ci_low"], row["ci_high"], row["p_t"]) == pytest.approx((mean, lo, hi, p))


def test_exploratory_families_are_holm_and_bh_adjusted_within_themselves(synthetic):
    _, _, rows, _, per_layer = synthetic
    for model, ref in (("A", "B"), ("D", "C")):
        family = [
            r for r in rows if r["role"] == "exploratory" and (r["model"], r["reference"]) == (model, ref)
        ]
        assert [r["layer"] for r in family] == list(LAYERS)
        p = []
        for row in family:
            get = per_layer[row["layer"]]
            mean, lo, hi, pt = paired_t([get(model, s) for s in SEEDS], [get(ref, s) for s in SEEDS])
            assert (row["diff_mean"], row["ci_low"], row["ci_high"]) == pytest.approx((mean, lo, hi))
            assert row["p_t"] == pytest.approx(pt, rel=1e-9) and row["verdict"] == "exploratory"
            p.append(pt)
        assert [r["p_holm"] for r in family] == pytest.approx(holm_loop(p), rel=1e-9)
        assert [r["q_bh"] for r in family] == pytest.approx(bh_loop(p), rel=1e-9)
        assert len(set(holm_loop(p))) > 1  # the family is not all adjusted to 1


def test_p_values_are_holm_adjusted_over_the_primaries_and_separately_over_the_secondaries(synthetic):
    _, _, rows, _, _ = synthetic
    primary = [r for r in rows if r["role"] == "primary"]
    secondary = [r for r in rows if r["role"] == "secondary"]
    assert len(primary) == 3 and len(secondary) >= 2
    assert [r["p_holm"] for r in primary] == pytest.approx(holm_loop([r["p_t"] for r in primary]), rel=1e-9)
    assert [r["p_holm"] for r in secondary] == pytest.approx(
        holm_loop([r["p_t"] for r in secondary]), rel=1e-9
    )


def test_only_an_exploratory_claim_is_read_per_a_key():
    Claim("A", "B", LAYERED, "exploratory")  # an exploratory endpoint read alone
    with pytest.raises(ValueError, match="a primary claim is one test, not one per 'layer'"):
        Claim("A", "B", LAYERED, "primary", per="layer")
    with pytest.raises(ValueError, match="role must be"):
        Claim("A", "B", LAYERED, "tertiary")


def test_of_largest_reads_that_fraction_of_the_largest_key_present():
    from lime_probe.studies.study import OfLargest

    rows = [{"step": float(s), "val_loss": s / 100} for s in range(1, 21)] + [{"other": 1, "val_loss": 9.0}]
    e = Endpoint("held-out loss", "curves", "val_loss", {"step": OfLargest(0.75)})
    assert e.of(rows) == 0.15 and e.of(rows[:8]) == 0.06  # step 15 of 20; step 6 of 8
    assert e.label() == "held-out loss (step 0.75 x the largest)"
    with pytest.raises(ValueError, match="no row"):
        e.of(rows[:9])  # 0.75 x 9 is no step present


# --------------------------------------------------------------------------- the catalog


def sides(side):
    return sides(side.model) + sides(side.reference) if isinstance(side, Effect) else [side]


# what a measure may read, by its analysis's kind of data
TEXTS = {"test", "test-windows", "expressions"}
READS = {"none": {"none"}, "optional-texts": {"none", *TEXTS}, "texts": TEXTS, "blimp": {"blimp"}}


def check_consistent(study: Study) -> None:
    from lime_probe.specs import ANALYSES

    per_run = {name for name, m in study.measures.items() if m.per == "run"}
    for claim in study.claims:
        where = f"{study.name}: {claim.endpoint.label()} {sides(claim.model)} - {sides(claim.reference)}"
        assert set(sides(claim.model) + sides(claim.reference)) <= set(study.models), where
        for side, endpoint in zip((claim.model, claim.reference), claim.endpoints, strict=True):
            assert endpoint.measure in per_run, where
            measured = study.measures[endpoint.measure].models  # each side is measured where it is read
            assert measured is None or set(sides(side)) <= set(measured), where
    for name, m in study.measures.items():
        assert m.analysis in ANALYSES, f"{study.name}: {name}"
        spec = ANALYSES[m.analysis]
        spec.params(**m.params)  # the declared parameters are the analysis's
        assert set(m.models or ()) <= set(study.models), f"{study.name}: {name}"
        reads_shared = m.data in ("test", "test-windows", "blimp")
        assert not reads_shared or study.needs_data, f"{study.name}: {name} reads {m.data} without --data"
        assert m.data in READS[spec.data_kind], f"{study.name}: {name} reads {m.data}"
    # a study tests a primary claim or makes a declared selection (a learning-rate sweep)
    assert any(c.role == "primary" for c in study.claims) or study.select is not None, study.name
    if study.select is not None:
        assert study.select.endpoint.measure in per_run, study.name
        for labels in study.select.families.values():
            assert len(labels) > 1 and set(labels) <= set(study.models), study.name
    assert len(set(study.seeds)) >= 2 and len(set(study.seeds)) == len(study.seeds), study.name


@pytest.mark.parametrize("name", list(STUDIES))
def test_every_declared_study_is_consistent_at_both_sizes(name):
    study = STUDIES[name]
    assert study.name == name and study.sized("full") is study
    check_consistent(study)
    tiny = study.sized("tiny")
    check_consistent(tiny)
    assert set(study.tiny.get("measures", {})) <= set(study.measures)  # no override of a measure not there
    assert tiny.claims == study.claims and list(tiny.models) == list(study.models)
    for label, overrides in study.models.items():  # the tiny size only adds to a model's own overrides
        assert tiny.models[label] == {**overrides, **study.tiny.get("models", {}).get(label, {})}
    for k, changes in study.tiny.get("measures", {}).items():
        for field, v in changes.items():
            got = getattr(tiny.measures[k], field)
            assert got == ({**study.measures[k].params, **v} if field == "params" else v)
    assert tiny.seeds == tuple(study.tiny.get("seeds", study.seeds))


def test_a_size_other_than_full_or_tiny_is_refused():
    with pytest.raises(ValueError, match="size must be"):
        STUDIES["lm-cpu"].sized("medium")


@pytest.mark.parametrize(
    "ablation, plain, kv_proj_init",
    [("LIME_LLAMA_KV", "LIME", "normal"), ("LLAMA_TORCH_KV", "LLAMA", "torch")],
)
def test_kv_init_ablations_change_only_the_kv_init(ablation, plain, kv_proj_init):
    """The k/v-init ablations are LIMe (LLaMA) with the other model's k/v init, nothing else."""
    from helpers import tiny_tokenizer

    from lime_model.recipes import load_recipe
    from lime_model.train import model_config
    from lime_probe.studies import parts

    tok = tiny_tokenizer()
    base, changed = (
        model_config(load_recipe("wikitext-cpu", {"data": "x.txt", **getattr(parts, o)}), tok)
        for o in (plain, ablation)
    )
    assert changed.to_dict() == {**base.to_dict(), "kv_proj_init": kv_proj_init}
    assert changed.kv_proj_torch_init == (not base.kv_proj_torch_init) == (kv_proj_init == "torch")


def test_the_separability_probe_orders_its_classes_as_the_words_are_declared(monkeypatch):
    """The official probe lays rows out class by class in its words' order (is, are, was, were), not
    sorted; the studies' separability measure passes its words in that order."""
    from lime_probe.probes import separability
    from lime_probe.specs import ANALYSES
    from lime_probe.specs.separability import separability_rows

    seen = {}
    real = separability.token_separability

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(separability, "token_separability", spy)
    m = STUDIES["lm-cpu"].measures["separability"]
    words = ANALYSES[m.analysis].params(**m.params).words
    assert tuple(words) == (" is", " are", " was", " were")
    rng = np.random.default_rng(0)
    y = np.array(list(words) * 10, dtype=object)
    rows = separability_rows({"m": ({0: rng.normal(size=(40, 3))}, y)}, site="values", classes=words)
    assert seen["classes"] == [" is", " are", " was", " were"] and [r["layer"] for r in rows] == [0]


# --------------------------------------------------------------------------- perplexity


def test_perplexity_is_lime_models_evaluation_and_a_hand_loop(tmp_path, monkeypatch):
    import torch
    from helpers import CORPUS, save_tiny_checkpoint

    from lime_model.data import load_texts
    from lime_model.evaluate import perplexity
    from lime_probe.specs import ANALYSES, load_checkpoints

    monkeypatch.setenv("LIME_MODEL_CACHE", str(tmp_path / "cache"))
    ckpt = save_tiny_checkpoint(tmp_path / "ckpt", "llama")
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(CORPUS * 3) + "\n")
    window = 16
    spec = ANALYSES["perplexity"]
    (ck,) = load_checkpoints([str(ckpt)], ["m"], "cpu")
    (row,) = spec.compute([ck], load_texts(str(path)), spec.params(window=window), Extraction()).rows
    reference = perplexity(ckpt, str(path), window=window)
    assert row["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-6)
    assert (row["windows"], row["tokens"]) == (reference["windows"], reference["tokens"])

    # by hand: each document's tokens then EOS, concatenated, cut into windows, the tail dropped; every
    # token but a window's first predicted from those before it
    tok, model = ck.tokenizer, getattr(ck.model, "_module", ck.model)
    stream = []
    for doc in CORPUS * 3:
        stream += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    n = len(stream) // window
    ids = torch.tensor(stream[: n * window]).view(n, window)
    nll = []
    with torch.no_grad():
        for w in ids:
            logp = torch.log_softmax(model(input_ids=w[None]).logits[0].double(), -1)
            nll += [-logp[t, w[t + 1]].item() for t in range(window - 1)]
    assert n >= 3 and row["windows"] == n and row["tokens"] == len(nll)
    assert row["loss"] == pytest.approx(sum(nll) / len(nll), rel=1e-5)
    assert row["perplexity"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


# --------------------------------------------------------------------------- bad input


BAD = [
    ({"name": "lm-gpu"}, "unknown study 'lm-gpu'"),
    ({"name": "lm-cpu"}, "needs --data"),
    ({"name": "arithmetic-seeds", "data": "x"}, "makes its own data"),
    ({"name": "arithmetic-seeds", "seeds": [3]}, "at least two distinct"),
    ({"name": "arithmetic-seeds", "seeds": [1, 1]}, "at least two distinct"),
]


@pytest.mark.parametrize("kw, message", BAD)
def test_bad_input_to_run_study_is_a_one_line_value_error(tmp_path, kw, message):
    kw = dict(kw)
    with pytest.raises(ValueError, match=message) as error:
        run_study(kw.pop("name"), out=tmp_path / "o", size="tiny", **kw)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--study", "lm-cpu"], "needs --data"),
        (["--study", "arithmetic-seeds", "--data", "x"], "makes its own data"),
        (["--study", "arithmetic-seeds", "--seeds", "3"], "at least two distinct"),
        (["--study", "arithmetic-seeds", "--seeds", "1,1"], "at least two distinct"),
        (["--study", "lm-gpu"], "lm-gpu"),
    ],
)
def test_bad_input_through_the_cli_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, argv, message):
    from lime_probe import cli

    out = tmp_path / "o"
    code = cli.main(["reproduce", "--size", "tiny", "--out", str(out), "--threads", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_measurement_keys_follow_the_datas_content_not_its_file_times(tmp_path):
    """A copied or re-provisioned data folder (new modification times) keeps every cached measurement;
    a changed byte invalidates exactly the measures that read that file."""
    import hashlib
    import os
    import shutil

    from lime_probe.studies.runner import Data, measure_key

    src = tmp_path / "a"
    (src / "wikitext-2").mkdir(parents=True)
    (src / "blimp").mkdir()
    (src / "wikitext-2" / "valid.txt").write_text("train text\n")
    (src / "wikitext-2" / "test.txt").write_text("held-out text\n")
    (src / "blimp" / "p.jsonl").write_text('{"sentence_good": "a", "sentence_bad": "b"}\n')
    copy = tmp_path / "b"
    shutil.copytree(src, copy, copy_function=shutil.copyfile)  # contents only: fresh times
    for f in copy.rglob("*.*"):
        os.utime(f, ns=(1, 1))
    on_test, on_blimp = Measure("entropy", data="test-windows"), Measure("blimp", data="blimp")
    a, b = Data.under(src), Data.under(copy)
    assert a.digests["test"] == [["test.txt", hashlib.sha256(b"held-out text\n").hexdigest()]]
    for m in (on_test, on_blimp):
        assert measure_key(m, ["fp"], a) == measure_key(m, ["fp"], b)
        assert measure_key(m, ["fp"], a) != measure_key(m, ["other fp"], a)
    (copy / "wikitext-2" / "test.txt").write_text("held-out text!\n")
    changed = Data.under(copy)
    assert measure_key(on_test, ["fp"], changed) != measure_key(on_test, ["fp"], a)
    assert measure_key(on_blimp, ["fp"], changed) == measure_key(on_blimp, ["fp"], a)


# --------------------------------------------------------------------------- cross-site claims, selection


def test_a_cross_site_claim_reads_each_side_at_its_own_site(synthetic):
    """The official analysis's comparison: the model at one site, the reference at another; mean and
    per layer, against scipy on the hand-picked rows."""
    from dataclasses import replace

    study, measured, _, _, _ = synthetic
    hidden = Endpoint("spread", "layered", "y", {"site": "hidden"}, over=("layer",))
    claims = (
        Claim("A", "B", LAYERED, "secondary", None, reference_endpoint=hidden),
        Claim("A", "B", LAYERED, "exploratory", per="layer", reference_endpoint=hidden),
    )
    rows = compare(replace(study, claims=claims), measured, SEEDS)

    def at(m, s, site, la=None):
        picked = [
            r["y"]
            for r in measured["layered"][m, s]["rows"]
            if r["site"] == site and la in (None, r["layer"])
        ]
        return float(np.mean(picked))

    a = [at("A", s, "values") for s in SEEDS]
    b = [at("B", s, "hidden") for s in SEEDS]
    mean, lo, hi, p = paired_t(a, b)
    assert rows[0]["diff_mean"] == pytest.approx(mean) and rows[0]["p_t"] == pytest.approx(p, rel=1e-9)
    assert (rows[0]["ci_low"], rows[0]["ci_high"]) == pytest.approx((lo, hi))
    assert rows[0]["endpoint"] == "spread (values; mean over layers) vs spread (hidden; mean over layers)"
    same_site = compare(replace(study, claims=(Claim("A", "B", LAYERED, "secondary"),)), measured, SEEDS)
    assert abs(rows[0]["diff_mean"] - same_site[0]["diff_mean"]) > 1e-6  # the sites matter here
    for r in rows[1:]:
        la = r["layer"]
        want = paired_t([at("A", s, "values", la) for s in SEEDS], [at("B", s, "hidden", la) for s in SEEDS])
        assert r["diff_mean"] == pytest.approx(want[0]) and r["p_t"] == pytest.approx(want[3], rel=1e-9)


def test_a_selection_chooses_the_lowest_mean_per_family_and_never_a_diverged_one(synthetic):
    from dataclasses import replace

    from lime_probe.studies import Selection
    from lime_probe.studies.findings import findings, selection_table

    study, measured, _, values, _ = synthetic
    sel = Selection(SCALAR, {"low": ("A", "C"), "mid": ("B", "D")})
    table = selection_table(replace(study, claims=(), select=sel), measured, SEEDS)
    means = {m: np.mean([values["score"](m, s) for s in SEEDS]) for m in "ABCD"}
    chosen = {r["model"] for r in table if r["chosen"]}
    assert chosen == {"C", "B" if means["B"] < means["D"] else "D"}
    for r in table:
        assert r["mean"] == pytest.approx(means[r["model"]])
        assert r["std"] == pytest.approx(np.std([values["score"](r["model"], s) for s in SEEDS], ddof=1))
    assert sel.choose({"A": float("nan"), "C": 5.0, "B": 1.0, "D": 0.0}) == {"low": "C", "mid": "D"}
    text = findings(replace(study, claims=(), select=sel), [], SEEDS, table)
    assert "## Selection" in text and "Primary endpoints" not in text and text.count("**chosen**") == 2


def test_measuring_a_seed_frees_its_models(tmp_path, monkeypatch):
    """A model that has been traced sits in a reference cycle (nnsight's), which only the cyclic
    collector frees; the checkpoints a seed's measures loaded are freed when its measuring ends, so a
    study on a GPU does not keep seed after seed's models on the device."""
    import weakref

    from helpers import collector_off, save_tiny_checkpoint

    from lime_probe.extraction.tracing import extract
    from lime_probe.specs.base import Result
    from lime_probe.studies import runner

    runs = {
        label: save_tiny_checkpoint(tmp_path / label, arch) for label, arch in (("A", "lime"), ("B", "llama"))
    }
    loaded: list[weakref.ref] = []

    def measure(m, cks, run_dirs, data):  # traces the model, as every measure that reads it does
        extract(cks[0].model, cks[0].tokenizer, ["the cat sat on the mat"], sites=["values"], progress=False)
        loaded.append(weakref.ref(cks[0].model))
        return Result(analysis="entropy", name="stub", title="stub", rows=[{"model": cks[0].label, "x": 1.0}])

    monkeypatch.setattr(runner, "run_measure", measure)
    study = Study(
        name="frees", question="?", recipe="none", models={"A": {}, "B": {}}, seeds=(0, 1),
        measures={"x": Measure("entropy")}, claims=(),
    )  # fmt: skip
    with collector_off():
        measured = runner.measure_runs(study, tmp_path / "out", 0, runs, None, "cpu", runner.Progress(2))
        assert len(loaded) == 2 and [ref() for ref in loaded] == [None, None]
    assert set(measured["x"]) == {"A", "B"}
