"""The measurement protocol of each analysis, stated once: every setting's default, its alternatives and
where the default comes from.

Sources: "paper" (the LIMe paper states it; `where` names the section, table or appendix and `quote` holds
the passage), "reading" (the paper is ambiguous; `quote` holds the passages and `note` says how we read
them), "official code" (github.com/corl-team/lime; `where` names the file, and the snapshot where it is not
the current tree), "Skean et al. code" (github.com/OFSkean/information_flow; `where` names the file) and
"ours" (neither states it; our choice). Where the paper and the official code differ the default follows
the paper and the official behaviour is an alternative (or, for the value site, is reported beside it).

    from lime_probe.protocol import defaults
    defaults("tsne")      # {"site": "values", "l2_normalize": True, ...}
    print(markdown_table())   # the probe rows of docs/fidelity.md

Kept free of heavy imports (no torch, numpy or sklearn), so command-line help can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SOURCES = ("paper", "reading", "official code", "Skean et al. code", "ours")

# The official code measures packed rows of its training length (configs/config_base.yaml seq_length).
OFFICIAL_WINDOW = 2048
# Table 2 probes blocks 10-16 of the paper's 16-block models: the top 7 of 16.
PAPER_LAYER_FRACTION = 7 / 16
# The BLiMP tasks of the Table 2 preset: Appendix D's ten paradigms, in its order (the example pair of each
# in Table 10 is a row of that paradigm's file in the BLiMP release).
TABLE2_TASKS = (
    "determiner_noun_agreement_with_adj_irregular_1",
    "complex_NP_island",
    "regular_plural_subject_verb_agreement_2",
    "determiner_noun_agreement_with_adj_2",
    "determiner_noun_agreement_1",
    "determiner_noun_agreement_2",
    "irregular_plural_subject_verb_agreement_1",
    "irregular_plural_subject_verb_agreement_2",
    "distractor_agreement_relational_noun",
    "determiner_noun_agreement_with_adjective_1",
)
# What the BLiMP tables' "+-" may be: the mean over tasks of each task's std over CV folds, or the std over tasks.
BLIMP_SPREADS = ("folds", "tasks")
# The value sites as figures and tables name them: the paper's values and the official analysis's.
SITE_LABELS = {
    "values": "values (W_V output)",
    "routed_values": "routed values (what LIMe's heads attend to)",
}


@dataclass(frozen=True)
class Setting:
    """One setting of an analysis: its default, where that comes from, and the offered alternatives.

    source: one of `SOURCES`; where: the paper's section, table or appendix (for "paper" and "reading"), or
    the code's file (for "official code" and "Skean et al. code"); quote: the paper's passages, verbatim (one
    for "paper", each of the ambiguous ones for "reading").
    """

    name: str
    default: Any
    source: str
    alternatives: tuple = ()
    note: str = ""
    where: str = ""
    quote: tuple[str, ...] = ()


def _value_sites(figure: str) -> tuple[Setting, Setting]:
    """The value site: the W_V output (Sec. 5.3) and, beside it for a model that routes, the routed values
    the official analysis records as LIMe's values."""
    return (
        Setting(
            "site",
            "values",
            "paper",
            ("hidden", "keys", "routed_values"),
            f"the W_V output ({figure})",
            "Sec. 5.3",
            ("we record value states (i.e., the output of the $W_{\\ell}^{(V)}$ linear projection)",),
        ),
        Setting(
            "routed_values",
            "also, for a model that routes",
            "official code",
            ("--site values",),
            "the official analysis records LIMe's routed values as its values; by default both are reported, "
            "labelled; a model without routing has only the W_V output",
            "src/analysis/value_wrapper.py",
        ),
    )


_FOLDS = ("Figure 2(b) shows five-fold classification accuracies",)

PROTOCOL: dict[str, tuple[Setting, ...]] = {
    "entropy": (
        *_value_sites("Fig. 2a"),
        Setting(
            "unit",
            "windows",
            "official code",
            ("documents",),
            "packed fixed-length rows, as the training data",
            "src/analysis/entropy.py, over the rows of src/datasets/preprocessing_fineweb.py",
        ),
        Setting(
            "framing",
            "BOS + document + EOS",
            "official code",
            (),
            "each document framed as the official training rows; the project's own training packs document + "
            "EOS (lime_model.data, ours), so in a project model's windows each document boundary holds one "
            "separator token it never trained on (GPT-2's tokenizer: BOS = EOS, a doubled EOS); kept so that "
            "official and project checkpoints are measured on the same tokens",
            "src/datasets/preprocessing_fineweb.py",
        ),
        Setting(
            "window",
            OFFICIAL_WINDOW,
            "official code",
            ("any length",),
            "2048-token rows, capped by the model's max positions (ours)",
            "configs/config_base.yaml, data_config.seq_length",
        ),
        Setting("num_windows", 64, "ours", ("any count",), "drawn without replacement, seeded"),
        Setting(
            "preset",
            "lime",
            "official code",
            ("layer-by-layer",),
            "z-score over the layer, alpha 0.5; layer-by-layer follows Skean et al. code",
            "src/analysis/entropy.py, calculate_entropy",
        ),
        Setting("max_normalize", False, "ours", (True,), "Skean et al.'s code divides by log(min(N, D))"),
    ),
    "separability": (
        *_value_sites("Fig. 2b"),
        Setting(
            "words",
            (" is", " are", " was", " were"),
            "paper",
            ("any words",),
            "",
            "Sec. 5.3",
            ("extracting 1668 occurrences each of is, are, was, were from FineWeb Edu",),
        ),
        Setting(
            "balance",
            True,
            "paper",
            (False,),
            "every word subsampled to the rarest word's count",
            "Sec. 5.3",
            ("1668 occurrences each",),
        ),
        Setting(
            "method",
            "adam-linear",
            "official code",
            ("logreg",),
            "the paper names no classifier; the official probe is nn.Linear on the raw features, Adam lr 1e-2, "
            "batch 64, one epoch, accuracy averaged over test batches; logreg is our converged standardised "
            "logistic regression",
            "src/analysis/classification.py",
        ),
        Setting(
            "n_splits",
            5,
            "paper",
            ("any",),
            "adam-linear: plain shuffled KFold, as the official src/analysis/classification.py; logreg: "
            "stratified (ours)",
            "Sec. 5.3, Fig. 2",
            _FOLDS,
        ),
        Setting(
            "seed",
            0,
            "ours",
            ("42: the official src/analysis/classification.py's",),
            "folds, initialisation, shuffling, balance",
        ),
        Setting("subtoken", "last", "ours", ("mean",), "multi-token words (numbers, Fig. 4a/8)"),
        Setting(
            "context",
            "documents of at most 256 tokens, at most 1,000",
            "ours",
            ("--max-length", "--max-sequences"),
            "the command's defaults; the official src/analysis/representations.py reads its words in the "
            "2048-token training rows; the studies probe every window of their held-out text",
        ),
        Setting(
            "count",
            "every occurrence, balanced to the rarest word",
            "ours",
            (),
            "no target: Sec. 5.3's 1668 occurrences each is the count its text gave; more text gives more "
            "rows, fewer than 10 per word and test fold is refused (--allow-small-samples)",
        ),
    ),
    "tsne": (
        *_value_sites("Fig. 3"),
        Setting(
            "l2_normalize",
            True,
            "official code",
            (False,),
            "rows L2-normalised before t-SNE",
            "src/analysis/representations.py, hiddens_tsne",
        ),
        Setting(
            "perplexity",
            30.0,
            "official code",
            ("any",),
            "sklearn's default there; openTSNE here (ours)",
            "src/analysis/representations.py, hiddens_tsne",
        ),
        Setting(
            "per_word",
            100,
            "ours",
            ("any count",),
            "points per word in each map, drawn with the seed (0); the studies draw 150 per word and seed; the "
            "official hiddens_tsne (src/analysis/representations.py) takes every occurrence unless given a count",
        ),
    ),
    "blimp": (
        Setting(
            "tasks",
            "table2",
            "paper",
            ("all", "any paradigms"),
            "Appendix D's ten paradigms, in its order (TABLE2_TASKS), each checked against Table 10's example",
            "App. D",
            ("We evaluate linguistic sensitivity using ten BLiMP minimal-pair tasks",),
        ),
        Setting(
            "max_pairs",
            None,
            "paper",
            ("any count",),
            "None: every pair (BLiMP has 1,000 per paradigm)",
            "App. D",
            ("full datasets are from the public BLiMP repository",),
        ),
        Setting(
            "sites",
            ("values", "hidden"),
            "paper",
            ("any site",),
            "and, for a model that routes, routed_values (official code, src/analysis/value_wrapper.py)",
            "Sec. 5.3",
            (
                "we extract (i) attention values (the value projections) and (ii) hidden states (the "
                "residual stream)",
            ),
        ),
        Setting(
            "pool",
            "mean",
            "paper",
            (),
            "one mean-pooled row per sentence",
            "Sec. 5.3",
            ("mean-pool them over tokens to obtain a fixed vector per sentence",),
        ),
        Setting(
            "layers",
            f"upper {PAPER_LAYER_FRACTION:.4g} of blocks",
            "paper",
            ("all",),
            "blocks 10-16 of 16; the same fraction at other depths is ours (`blimp.paper_layers`)",
            "Table 11, Table 4",
            ("across layers 10–16", "Number of Hidden Layers 16"),
        ),
        Setting(
            "n_splits",
            5,
            "paper",
            ("any",),
            "cross-validation folds",
            "Sec. 5.3",
            ("We perform 5-fold cross-validation",),
        ),
        Setting(
            "groups",
            "pairID",
            "paper",
            (),
            "the two sentences of a pair always share a fold",
            "Sec. 5.3",
            ("splitting by minimal pair so that both members of a pair fall in the same fold",),
        ),
        Setting(
            "method",
            "logreg",
            "paper",
            ("adam-linear",),
            "standardising the features first is ours",
            "Sec. 5.3",
            ("train a binary logistic-regression probe",),
        ),
        Setting(
            "table",
            "per block: the mean over tasks",
            "reading",
            ("one number: each task's mean over the blocks, then the mean over tasks (ours)",),
            "both tables list one accuracy per layer for the ten tasks without saying how the tasks combine; "
            "we read it as their mean (`blimp.blimp_layer_table`)",
            "Table 2, Table 11",
            (
                "BLiMP probing accuracy (5-fold CV) at selected layers",
                "probing accuracy (5-fold CV) across layers 10–16",
            ),
        ),
        Setting(
            "spread",
            "folds",
            "reading",
            ("tasks: the std over tasks of the task accuracies",),
            "the +-: the mean over tasks of each task's std (ddof=0) over its 5 folds; the captions say only "
            "5-fold CV, Fig. 2's +- is the std over the five folds, and the paper's +-0.010-0.018 is the size "
            "of fold noise, not of the spread over tasks; `blimp --spread tasks` reports the latter",
            "Table 2, Fig. 2",
            (
                "BLiMP probing accuracy (5-fold CV) at selected layers",
                "with standard deviation over five cross-validation folds",
            ),
        ),
        Setting("C", 1.0, "ours", ("any",), "inverse regularisation strength (sklearn's default)"),
        Setting("solver", "lbfgs", "ours", (), "sklearn's default; features standardised first"),
        Setting("max_iter", 10_000, "ours", ("any",), "iterations to converge"),
        Setting("seed", 0, "ours", ("any",), "the shuffle of the pair-grouped folds"),
        Setting("too_long", "skip and count per paradigm", "ours", (), "an all-skipped paradigm is an error"),
        Setting(
            "tokens",
            "prefix token + sentence",
            "ours",
            ("sentence as the tokenizer encodes it",),
            "the probe pools the same sequence the minimal-pair score reads (BOS, else EOS, then the sentence "
            "without special tokens), so one forward pass gives both; unchanged for a tokenizer that adds BOS. "
            "Sec. 5.3 mean-pools over tokens without naming a prefix. Kept, not dropped: in a causal model the "
            "prefix's representation is the same for the good and the bad sentence, so it adds no information "
            "of its own beyond the sentence's length n (the mean is (prefix + n tokens) / (n + 1)); dropping "
            "it would change every committed BLiMP number",
        ),
        Setting(
            "leading_space",
            False,
            "ours",
            (True,),
            "score (and probe) each sentence as it tokenizes at the start of a text; `blimp --leading-space` "
            "scores it after a space, as lm-evaluation-harness does (its BLiMP task puts the sentence after the "
            "default target delimiter, a space), and gives lm-eval's per-pair log-probabilities. The paper "
            "probes only (Sec. 5.3) and names no minimal-pair scoring; kept off so that the committed BLiMP "
            "numbers stay what they are",
        ),
    ),
}


def defaults(analysis: str) -> dict[str, Any]:
    """{setting: default} of `analysis` ("entropy", "separability", "tsne", "blimp")."""
    if analysis not in PROTOCOL:
        raise ValueError(f"unknown analysis {analysis!r}; choose one of {sorted(PROTOCOL)}")
    return {s.name: s.default for s in PROTOCOL[analysis]}


def protocol_rows() -> list[dict[str, Any]]:
    """Every setting as a flat row (analysis, setting, default, source, alternatives, note, where, quote)."""
    return [
        {
            "analysis": analysis,
            "setting": s.name,
            "default": s.default,
            "source": s.source,
            "alternatives": list(s.alternatives),
            "note": s.note,
            "where": s.where,
            "quote": list(s.quote),
        }
        for analysis, settings in PROTOCOL.items()
        for s in settings
    ]


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(f"'{v}'" if isinstance(v, str) and v.startswith(" ") else str(v) for v in value)
    return str(value)


def markdown_table() -> str:
    """The probe rows of docs/fidelity.md, generated from `PROTOCOL` (one row per setting, no trailing
    newline): area, setting, default (with the note), source (with where the paper says it and its words)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| area | setting | our default | source |", "|---|---|---|---|"]
    for analysis, settings in PROTOCOL.items():
        for s in settings:
            default = f"`{_shown(s.default)}`" + (f"; {s.note}" if s.note else "")
            source = s.source + (f" ({s.where}" if s.where else "")
            if s.quote:
                source += ": " + " / ".join(f'"{q}"' for q in s.quote)
            source += ")" if s.where else ""
            lines.append(f"| {analysis} | {s.name} | {cell(default)} | {cell(source)} |")
    return "\n".join(lines)
