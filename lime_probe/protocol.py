"""The measurement protocol of each analysis, stated once: every setting's default, its alternatives and
where the default comes from.

Sources: "paper" (stated in the LIMe paper), "official code" (github.com/corl-team/lime, src/analysis and
src/datasets), "Skean et al. code" (github.com/OFSkean/information_flow) and "ours" (neither states it;
our choice). Where the paper and the official code differ the default follows the paper and the official
behaviour is an alternative. Settings marked "paper" from issue 8's reading of the paper (figure and
table references in `note`) were not re-checked against the paper text here.

    from lime_probe.protocol import defaults
    defaults("tsne")      # {"site": "values", "l2_normalize": True, ...}

Kept free of heavy imports (no torch, numpy or sklearn), so command-line help can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The official code measures packed rows of its training length (configs/config_base.yaml seq_length).
OFFICIAL_WINDOW = 2048
# Table 2 probes blocks 10-16 of the paper's 16-block models: the top 7 of 16.
PAPER_LAYER_FRACTION = 7 / 16
# The BLiMP tasks of the Table 2 preset. OUR CHOICE, not the paper's: the paper's Appendix D names 10
# tasks, but its list could not be checked offline, so these are 10 agreement/morphology paradigms of
# the release (the phenomena the paper's collapse argument is about). Replace them with the paper's
# list where it is at hand (``--paradigms``).
TABLE2_TASKS = (
    "anaphor_number_agreement",
    "determiner_noun_agreement_1",
    "determiner_noun_agreement_2",
    "determiner_noun_agreement_irregular_1",
    "distractor_agreement_relational_noun",
    "irregular_plural_subject_verb_agreement_1",
    "regular_plural_subject_verb_agreement_1",
    "irregular_past_participle_verbs",
    "existential_there_quantifiers_1",
    "principle_A_case_1",
)


@dataclass(frozen=True)
class Setting:
    """One setting of an analysis: its default, where that comes from, and the offered alternatives."""

    name: str
    default: Any
    source: str
    alternatives: tuple = ()
    note: str = ""


def _values_site(where: str) -> Setting:
    """The value-vector site (W_V outputs); the official code reads LIMe's routed values instead."""
    return Setting("site", "values", "paper", ("hidden", "keys", "routed_values"), where)


PROTOCOL: dict[str, tuple[Setting, ...]] = {
    "entropy": (
        _values_site("value-vector entropy (abstract, Fig. 2a)"),
        Setting(
            "unit",
            "windows",
            "official code",
            ("documents",),
            "packed fixed-length rows, as the training data",
        ),
        Setting(
            "window",
            OFFICIAL_WINDOW,
            "official code",
            ("any length",),
            "2048-token rows (configs seq_length), capped by the model's max positions (ours)",
        ),
        Setting("num_windows", 64, "ours", ("any count",), "drawn without replacement, seeded"),
        Setting(
            "preset",
            "lime",
            "official code",
            ("layer-by-layer",),
            "z-score over the layer, alpha 0.5; layer-by-layer follows Skean et al. code",
        ),
        Setting("max_normalize", False, "ours", (True,), "Skean et al.'s code divides by log(min(N, D))"),
    ),
    "separability": (
        _values_site("Fig. 2b"),
        Setting("words", (" is", " are", " was", " were"), "paper", ("any words",), "1,668 occurrences each"),
        Setting("balance", True, "paper", (False,), "every word subsampled to the rarest word's count"),
        Setting(
            "method",
            "logreg",
            "ours",
            ("adam-linear",),
            "the paper names no classifier; adam-linear is the official code's one-epoch probe",
        ),
        Setting("n_splits", 5, "official code", ("any",), "stratified here; plain shuffled KFold there"),
        Setting("subtoken", "last", "ours", ("mean",), "multi-token words (numbers, Fig. 4a/8)"),
    ),
    "tsne": (
        _values_site("Fig. 3"),
        Setting("l2_normalize", True, "official code", (False,), "rows L2-normalised before t-SNE"),
        Setting(
            "perplexity", 30.0, "official code", ("any",), "sklearn's default there; openTSNE here (ours)"
        ),
    ),
    "blimp": (
        Setting(
            "tasks",
            "table2",
            "ours",
            ("all", "any paradigms"),
            "10 agreement/morphology paradigms (TABLE2_TASKS); the paper's Appendix D list could not be checked",
        ),
        Setting("sites", ("values", "hidden"), "paper", ("any site",), "Table 2"),
        Setting("pool", "mean", "paper", (), "one mean-pooled row per sentence"),
        Setting(
            "layers",
            f"upper {PAPER_LAYER_FRACTION:.4g} of blocks",
            "paper",
            ("all",),
            "blocks 10-16 of 16; the same fraction at other depths is ours (`blimp.paper_layers`)",
        ),
        Setting("n_splits", 5, "paper", ("any",), "cross-validation folds"),
        Setting("groups", "pairID", "ours", (), "the two sentences of a pair always share a fold"),
        Setting("method", "logreg", "ours", ("adam-linear",), "the paper names no classifier"),
        Setting("task_score", "mean over the layer range", "ours", (), "then mean +- std over tasks"),
        Setting("too_long", "skip and count per paradigm", "ours", (), "an all-skipped paradigm is an error"),
    ),
}


def defaults(analysis: str) -> dict[str, Any]:
    """{setting: default} of `analysis` ("entropy", "separability", "tsne", "blimp")."""
    if analysis not in PROTOCOL:
        raise ValueError(f"unknown analysis {analysis!r}; choose one of {sorted(PROTOCOL)}")
    return {s.name: s.default for s in PROTOCOL[analysis]}


def protocol_rows() -> list[dict[str, Any]]:
    """Every setting as a flat row (analysis, setting, default, source, alternatives, note), for a table."""
    return [
        {
            "analysis": analysis,
            "setting": s.name,
            "default": s.default,
            "source": s.source,
            "alternatives": list(s.alternatives),
            "note": s.note,
        }
        for analysis, settings in PROTOCOL.items()
        for s in settings
    ]
