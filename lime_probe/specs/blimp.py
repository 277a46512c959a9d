"""BLiMP per paradigm: good-vs-bad probes (paper Table 2, Appendix D) and, for causal LMs, minimal-pair
scoring (lm-evaluation-harness's rule).

The Table 2 protocol by default: ``tasks="table2"`` (`protocol.TABLE2_TASKS`, Appendix D's ten paradigms),
every pair of each (1,000; App. D: "full datasets"), mean-pooled values and hidden states (and, for a model
that routes, the routed values its heads attend to, the official analysis's values), the paper's layer range
(`blimp.paper_layers`), a logistic regression with 5-fold CV grouped by pair; reported per block as the
paper's Tables 2 and 11 (the mean over tasks, `blimp.blimp_layer_table`) and as one number per model and
site (each task's mean over those blocks, then the mean over tasks, `blimp.blimp_table`), each +- the mean over
tasks of each task's fold std (``spread="folds"``; ``"tasks"``: the std over tasks). Pairs with a
sentence longer than the model's positions are skipped and counted per paradigm (`blimp.fit_pairs`). All
sites of a paradigm's good and bad sentences and, for a causal LM, their minimal-pair scores come from one
extraction pass over the scored sequences (`blimp.scoring_sequences`: the BOS token, else EOS, then the
sentence; ours), the sentence after a space with ``leading_space`` (lm-evaluation-harness's convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

from lime_probe.extraction.settings import LAYERS_HELP, Extraction, layer_list
from lime_probe.extraction.sites import check_site
from lime_probe.protocol import BLIMP_SPREADS, TABLE2_TASKS, defaults

from .base import (
    SITE_HELP,
    Checkpoint,
    Result,
    Spec,
    curve,
    group,
    option,
    routing_note,
    seed_option,
    site_label,
    sites_text,
    slug,
    value_sites,
)
from .separability import METHODS, jobs_option

if TYPE_CHECKING:
    from lime_probe.probes.blimp import Spread
    from lime_probe.probes.separability import Method

PROTOCOL = defaults("blimp")


@dataclass(frozen=True)
class BlimpParams:
    sites: tuple[str, ...] | None = option(
        None,
        "representations to probe, mean-pooled per sentence (default: values and hidden, and for a model "
        f"that routes also routed_values, what its heads attend to): {SITE_HELP}",
        type=check_site,
        metavar="SITE",
    )
    tasks: str = option(
        PROTOCOL["tasks"],
        "paradigms when --paradigms is not given: 'table2', the paper's ten (Appendix D), or 'all' in --data",
        choices=("table2", "all"),
    )
    paradigms: tuple[str, ...] | None = option(
        None, "BLiMP paradigms to use (default: those of --tasks)", metavar="UID"
    )
    layers: str = option(
        "paper",
        "layers to probe: 'paper' (the upper 7/16 of blocks, blocks 10-16 of 16), or " + LAYERS_HELP,
    )
    max_pairs: int | None = option(
        PROTOCOL["max_pairs"],
        "at most N minimal pairs per paradigm (default: all, as the paper; BLiMP has 1,000)",
        metavar="N",
        positive=True,
    )
    method: str = option(
        PROTOCOL["method"],
        "probe: logistic regression (the paper's, features standardised) or the official code's one-epoch "
        "linear probe",
        choices=METHODS,
    )
    spread: str = option(
        PROTOCOL["spread"],
        "what the tables' +- is: 'folds', the mean over tasks of each task's std over its 5 CV folds (Fig. 2: "
        "'standard deviation over five cross-validation folds'; Tables 2 and 11: '(5-fold CV)'), or 'tasks', "
        "the std over tasks of the task accuracies",
        choices=BLIMP_SPREADS,
    )
    leading_space: bool = option(
        PROTOCOL["leading_space"],
        "score (and probe) each sentence after a space, as lm-evaluation-harness does (its per-pair "
        "log-probabilities); default: as the sentence tokenizes at the start of a text",
    )
    seed: int = seed_option()
    jobs: int = jobs_option()

    def __post_init__(self):
        if self.layers != "paper":
            layer_list(self.layers, "'paper', ")  # its syntax, before any data or model is read


def probed_layers(ck: Checkpoint, layers: str) -> list[int] | None:
    """The layer indices that ``layers`` ("paper", "all" or "0,3,5") names, for every site at once; None for
    all. "paper" gives the top blocks as negative indices: the same blocks of the per-block sites and of
    ``hidden`` (`blimp.paper_layers`)."""
    from lime_probe.probes.blimp import paper_layers

    if layers == "paper":
        return list(range(-len(paper_layers(int(ck.config.num_hidden_layers))), 0))
    return layer_list(layers, "'paper', ")


def probed_sites(ck: Checkpoint, p: BlimpParams) -> list[str]:
    """``p.sites``, or by default the values (and, for a model that routes, the routed values; `value_sites`)
    and the hidden states."""
    return list(p.sites) if p.sites is not None else [*value_sites(ck, None), "hidden"]


def chosen_paradigms(p: BlimpParams) -> list[str] | None:
    """The paradigms ``p`` asks for: ``p.paradigms``, else those of ``p.tasks`` (None: all in the data)."""
    if p.paradigms is not None:
        return list(p.paradigms)
    return list(TABLE2_TASKS) if p.tasks == "table2" else None


def _paradigms(data, p: BlimpParams) -> tuple[Any, list[str]]:
    """``data`` (a ``load_blimp`` dataset) cut to the paradigms ``p`` asks for, and those paradigms (Table
    2's in App. D's order); ValueError naming any the data lacks."""
    import numpy as np

    uids = np.asarray(data["UID"], dtype=object)
    wanted = chosen_paradigms(p)
    paradigms = sorted(set(uids)) if wanted is None else list(dict.fromkeys(wanted))
    missing = sorted(set(paradigms) - set(uids))
    if missing:
        raise ValueError(f"paradigms {missing} are not in the BLiMP data (give --paradigms or --tasks all)")
    return data.select(np.flatnonzero(np.isin(uids, paradigms))), paradigms


def _probe_rows(model: str, paradigm: str, site: str, res, n: int, skipped: int) -> tuple[list[dict], dict]:
    """One probe's rows (accuracy per layer) and its summary row (the minimal-pair accuracy left None)."""
    import numpy as np

    rows = [
        {
            "model": model,
            "paradigm": paradigm,
            "site": site,
            "layer": layer,
            "probe_accuracy_mean": float(m),
            "probe_accuracy_std": float(s),
            "n_pairs": n,
            "n_skipped": skipped,
        }
        for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True)
    ]
    best = int(np.argmax(res.accuracy_mean))
    summary = {
        "model": model,
        "site": site,
        "paradigm": paradigm,
        "task_accuracy": float(np.mean(res.accuracy_mean)),
        "best_layer": res.layers[best],
        "n_pairs": n,
        "n_skipped": skipped,
        "minimal_pair_accuracy": None,  # filled in by the caller for causal LMs
    }
    return rows, summary


def _minimal_pairs(logprobs: dict[str, Any], pairs) -> Any:
    """The minimal-pair scores of per-paradigm log-probabilities (rows [:n] good, [n:] bad) of ``pairs``."""
    import numpy as np

    from lime_probe.probes.blimp import minimal_pair_scores

    return minimal_pair_scores(
        np.concatenate([lp[: len(lp) // 2] for lp in logprobs.values()]),
        np.concatenate([lp[len(lp) // 2 :] for lp in logprobs.values()]),
        pairs,
    )


def _measure(
    ck: Checkpoint, data, paradigms: list[str], p: BlimpParams, extraction: Extraction
) -> tuple[list[dict], list[dict], dict[str, dict[str, Any]], dict[str, Any]]:
    """One checkpoint's probes of every paradigm (for a causal LM scored in the same pass): its rows,
    summary rows, ``{site: {paradigm: probe result}}`` and extra (minimal pairs, skipped pairs)."""
    import numpy as np

    from lime_model.checks import is_causal_lm
    from lime_probe.extraction.windows import max_positions
    from lime_probe.probes.blimp import blimp_probe, fit_pairs, scoring_sequences

    from .base import extract_site

    uids = np.asarray(data["UID"], dtype=object)
    kept, skipped = fit_pairs(data, ck.tokenizer, max_positions(ck.model), p.leading_space)
    picked = {q: kept[uids[kept] == q][: p.max_pairs] for q in paradigms}
    causal = is_causal_lm(ck.config)  # an encoder's pairs are probed, not scored
    sites = probed_sites(ck, p)
    settings = replace(extraction, layers=probed_layers(ck, p.layers))
    if causal:  # the scored sequences, probed and scored in the same pass
        settings = replace(settings, pretokenized=True)
    rows: list[dict] = []
    summary: list[dict] = []
    probes: dict[str, dict[str, Any]] = {}
    logprobs = {}
    for q in paradigms:
        part = data.select(picked[q])
        n = len(part)  # good and bad sentences in one pass: rows [:n] good, [n:] bad
        sentences = list(part["sentence_good"]) + list(part["sentence_bad"])
        texts = scoring_sequences(ck.tokenizer, sentences, p.leading_space) if causal else sentences
        acts = extract_site(ck, texts, sites, settings, pool="mean", logprobs=causal)
        if causal:
            logprobs[q] = acts.logprobs.numpy()
        for site in sites:
            res = blimp_probe(
                {la: acts[site][la][:n] for la in acts[site]},
                {la: acts[site][la][n:] for la in acts[site]},
                np.asarray(part["pairID"]),
                method=cast("Method", p.method),  # one of the option's choices
                seed=p.seed,
                progress=False,
                n_jobs=p.jobs,
            )
            probes.setdefault(site, {})[q] = res
            site_rows, site_summary = _probe_rows(ck.label, q, site, res, n, skipped[q])
            rows += site_rows
            summary.append(site_summary)
    extra: dict[str, Any] = {}
    if causal:
        scores = _minimal_pairs(logprobs, data.select(np.concatenate([picked[q] for q in logprobs])))
        extra["minimal_pairs"] = {
            "per_paradigm": scores.per_paradigm,
            "per_phenomenon": scores.per_phenomenon,
            "mean_over_paradigms": scores.mean_over_paradigms,
            "mean_over_phenomena": scores.mean_over_phenomena,
        }
        for row in summary:
            row["minimal_pair_accuracy"] = scores.per_paradigm[row["paradigm"]]
    extra["skipped_pairs"] = skipped
    return rows, summary, probes, extra


def _text(p: BlimpParams, paradigms: list[str], rows: list[dict]) -> str:
    """The result's description: what was probed, how, and how Table 2 reads it."""
    spread = {
        "folds": "+- the mean over tasks of each task's std over its 5 folds",
        "tasks": "+- the std over tasks",
    }[p.spread]
    chosen = "given paradigms" if p.paradigms is not None else f"tasks {p.tasks!r}"
    pairs = "every pair" if p.max_pairs is None else f"at most {p.max_pairs} pairs each"
    probe = {"logreg": "logistic regression", "adam-linear": "one-epoch linear"}[p.method]
    return (
        f"Per paradigm ({len(paradigms)}, {chosen}; {pairs}, pairs longer than the model's positions "
        f"skipped and counted): a {probe} probe ({p.method}) telling the mean-pooled representation of the "
        f"good sentence from the bad one, 5-fold CV grouped by pair, at the {p.layers!r} layers of {sites_text(rows)}; "
        f"Tables 2 and 11 layout (blimp_table2_layers): per block, the mean over tasks {spread}; "
        "blimp_table2: each task's mean over those blocks, then the mean over tasks per model and site "
        f"{spread}. For causal LMs also minimal-pair accuracy (summed log-probabilities "
        "after the BOS token, good > bad, as lm-evaluation-harness; means over paradigms and phenomena in "
        "the JSON)." + routing_note(rows, p.sites is None)
    )


def compute(cks: Sequence[Checkpoint], data, p: BlimpParams, extraction: Extraction) -> Result:
    """Per model, site and paradigm: probe accuracy per layer (rows), the Table 2 rows (``tables``), the
    task accuracy, best layer, skipped pairs and minimal-pair accuracy (summary). ``data`` is a
    ``load_blimp`` dataset."""
    from lime_probe.probes.blimp import blimp_layer_table, blimp_table

    data, paradigms = _paradigms(data, p)
    rows: list[dict] = []
    summary: list[dict] = []
    extra: dict[str, dict[str, Any]] = {}
    probes: dict[tuple[str, str], Any] = {}
    for ck in cks:
        ck_rows, ck_summary, by_site, extra[ck.label] = _measure(ck, data, paradigms, p, extraction)
        rows += ck_rows
        summary += ck_summary
        probes |= {(ck.label, site): found for site, found in by_site.items()}
    table2 = [
        {**{k: v for k, v in r.items() if k != "tasks"}, "layers": ",".join(map(str, r["layers"]))}
        for r in blimp_table(probes, cast("Spread", p.spread))
    ]
    return Result(
        "blimp",
        "blimp",
        "BLiMP probes and minimal pairs",
        rows,
        text=_text(p, paradigms, rows),
        extra={"blimp": extra},
        summary=summary,
        tables={
            "blimp_table2_layers": blimp_layer_table(probes, cast("Spread", p.spread)),
            "blimp_table2": table2,
        },
    )


def plot(result: Result) -> dict:
    import numpy as np

    from lime_probe.output import charts as C
    from lime_probe.output import plots as F

    table2 = [{**r, "site": site_label(r["site"])} for r in result.tables["blimp_table2"]]
    figures = {"blimp_table2": C.plot_blimp_table2(table2)}
    summary = result.summary or []
    paradigms = list(group(summary, "paradigm"))
    for site, in_site in group(result.rows, "site").items():
        for m, mine in group(in_site, "model").items():
            curves = {
                q: curve(rs, "probe_accuracy_mean", std="probe_accuracy_std")
                for q, rs in group(mine, "paradigm").items()
            }
            figures[f"blimp_{slug(site)}_{slug(m)}"] = C.plot_blimp_layers(curves, model=m, site=site)
        acc = {(r["paradigm"], r["model"]): r["task_accuracy"] for r in summary if r["site"] == site}
        labels = list(group(in_site, "model"))  # routed values: only the models that route
        figures[f"blimp_{slug(site)}_tasks"] = F.plot_heatmap(
            np.array([[acc[q, m] for m in labels] for q in paradigms]),
            row_labels=paradigms,
            col_labels=labels,
            xlabel="model",
            ylabel="paradigm",
            vmin=0.5,
            vmax=1.0,
            title=f"BLiMP task accuracy, mean over the probed layers ({site_label(site)})",
            cbar_label="probe accuracy",
        )
    return figures


SPEC = Spec(
    name="blimp",
    help="BLiMP good-vs-bad probes (paper Table 2) and minimal-pair scoring",
    example="lime-probe blimp --ckpt runs/lime --ckpt runs/llama --data data/blimp --out out/blimp\n"
    "lime-probe blimp --ckpt runs/lime --data data/blimp --paradigms anaphor_gender_agreement "
    "adjunct_island \\\n    --layers all --max-pairs 500 --out out/blimp-layers",
    params=BlimpParams,
    compute=compute,
    plot=plot,
    data_kind="blimp",
    notebook="blimp",
)
