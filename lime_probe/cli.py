"""``lime-probe``: the paper's analyses from the command line.

    lime-probe entropy --ckpt runs/lime --ckpt runs/llama --data valid.txt --site values --out out/

Every command compares one or more ``--ckpt`` side by side (named by ``--label``), writes
results as JSON and CSV (settings, checkpoint identity and versions recorded; see
``lime_probe.results``) and figures as PNG and PDF into ``--out``, and prints a compact table.

Output is staged in a hidden temporary folder beside ``--out`` and moved in only when the
command succeeds, so a failure or Ctrl-C never leaves half-written files there. Exit codes:
0 done, 2 bad usage or input (one line on stderr), 1 an unexpected failure, 130 interrupted.

Each command imports the probes it uses when it runs, so a command loads only what it needs.
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lime_probe import figures as F
from lime_probe.report import Section, Table, write_report
from lime_probe.results import run_metadata, write_results

PROG = "lime-probe"
SITES = ("hidden", "final", "values", "keys", "routed_values", "routed_keys")
DEFAULT_WORDS = (" is", " are", " was", " were")
# Errors that mean "the input is wrong" (exit 2), as opposed to a bug or a crash (exit 1).
BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, KeyError)


# --------------------------------------------------------------------------- checkpoints, data


@dataclass
class Checkpoint:
    """A loaded checkpoint: its label in tables and legends, its path or hub id, model and tokenizer."""

    label: str
    source: str
    model: object
    tokenizer: object

    @property
    def config(self):
        """The Hugging Face config (``model`` may be an nnsight wrapper)."""
        return getattr(self.model, "_module", self.model).config


def labels_for(ckpts: Sequence[str], labels: Sequence[str] | None) -> list[str]:
    """One label per checkpoint: the given ones, or each path's last component; must be unique."""
    if labels and len(labels) != len(ckpts):
        raise ValueError(f"got {len(labels)} --label for {len(ckpts)} --ckpt; give one label per checkpoint or none")
    out = list(labels) if labels else [Path(c.rstrip("/")).name or c for c in ckpts]
    dupes = sorted({x for x in out if out.count(x) > 1})
    if dupes:
        raise ValueError(f"checkpoint labels must be unique, {dupes} repeats; name them with --label")
    return out


def load_checkpoints(ckpts: Sequence[str], labels: Sequence[str] | None, device: str) -> list[Checkpoint]:
    """Load every checkpoint with ``lime_probe.load`` (errors name the offending path)."""
    names = labels_for(ckpts, labels)
    from lime_probe.loading import load

    out = []
    for label, ckpt in zip(names, ckpts, strict=True):
        model, tok = load(ckpt, device=device)
        out.append(Checkpoint(label, ckpt, model, tok))
    return out


def load_texts(spec: str, max_sequences: int) -> list[str]:
    """The first ``max_sequences`` documents of a local .txt/.jsonl/.parquet file or folder, or of
    ``hf:NAME[:CONFIG][:SPLIT]`` (``lime_model.data.load_texts``); ValueError if there is no text."""
    from lime_model.data import load_texts as _load

    return _load(spec, max_texts=max_sequences)


# --------------------------------------------------------------------------- analyses


@dataclass
class Analysis:
    """What one analysis produced: the flat table, structured extras, figures, and a summary."""

    name: str  # file stem of its results, e.g. "entropy_values"
    title: str
    rows: list[dict]
    text: str = ""
    extra: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)  # stem -> Figure
    columns: tuple[str, ...] = ()  # shown in the compact table (default: all)
    summary: list[dict] | None = None  # the compact table itself, where rows are too many to show

    def table(self) -> list[dict]:
        """The rows shown on the terminal and in the report."""
        if self.summary is not None:
            return self.summary
        return [{c: r.get(c) for c in self.columns} for r in self.rows] if self.columns else self.rows


def _layer_list(spec: str | None) -> list[int] | None:
    if spec in (None, "", "all"):
        return None
    try:
        return [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(f"--layers must be 'all' or comma-separated integers, got {spec!r}") from None


def extract_site(ck: Checkpoint, texts: Sequence[str], site: str, extract_kw: dict | None = None, **kw):
    """``lime_probe.extract`` of one site for one checkpoint; ``extract_kw`` holds the size limits,
    cache and layers (see ``extract_options``)."""
    from lime_probe.extraction import extract

    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; choose from {', '.join(SITES)}")
    return extract(ck.model, ck.tokenizer, texts, sites=[site], **{**(extract_kw or {}), **kw})


def extract_options(args) -> dict:
    """The extraction settings of a parsed command line, as ``extract`` keywords."""
    return {"layers": _layer_list(getattr(args, "layers", None)), "max_length": args.max_length,
            "max_tokens": args.max_tokens, "batch_size": args.batch_size, "cache_dir": args.cache}


def entropy_analysis(cks: Sequence[Checkpoint], texts: Sequence[str], *, site: str = "values", preset: str = "lime",
                     alpha: float | None = None, seed: int = 0, extract_kw: dict | None = None) -> Analysis:
    """Matrix entropy per layer of ``site`` for each checkpoint (paper Figures 2a, 4a, 7a)."""
    from lime_probe.entropy import layer_entropies

    knobs = {} if alpha is None else {"alpha": alpha}
    rows, series = [], {}
    for ck in cks:
        acts = extract_site(ck, texts, site, extract_kw)
        res = layer_entropies({layer: acts.sequences(site, layer) for layer in acts[site]},
                              preset=preset, seed=seed, **knobs)
        layers = sorted(res)
        for layer in layers:
            r = res[layer]
            rows.append({"model": ck.label, "site": site, "layer": layer, "entropy_mean": r.mean,
                         "entropy_std": r.std, "ci_low": r.ci_low, "ci_high": r.ci_high,
                         "n_sequences": len(r.values), "alpha": r.config.alpha})
        series[ck.label] = {"layers": layers, "mean": [res[la].mean for la in layers],
                            "low": [res[la].ci_low for la in layers], "high": [res[la].ci_high for la in layers]}
    used_alpha = rows[0]["alpha"]
    return Analysis(
        f"entropy_{site}", f"Matrix entropy of {site}", rows,
        text=(f"Matrix-based Renyi entropy (alpha={used_alpha:g}, preset {preset!r}) of each sequence's {site} per "
              f"layer; mean over {rows[0]['n_sequences']} sequences with a 95% bootstrap CI of the mean. Lower "
              "entropy means the tokens crowd into fewer directions (representation collapse)."),
        figures={f"entropy_{site}": F.plot_entropy(series, site=site, alpha=used_alpha)},
        columns=("model", "layer", "entropy_mean", "ci_low", "ci_high"))


def check_class_counts(labels: np.ndarray, classes: Sequence, minimum: int, what: str) -> None:
    """ValueError naming every class of ``classes`` with fewer than ``minimum`` rows in ``labels``."""
    found = dict(zip(*np.unique(labels, return_counts=True), strict=True)) if len(labels) else {}
    short = {c: int(found.get(c, 0)) for c in classes if found.get(c, 0) < minimum}
    if short:
        counts = ", ".join(f"{c!r}: {n}" for c, n in short.items())
        raise ValueError(f"{what} too rare in the data (need at least {minimum} each): {counts}; "
                         "give more data (--data, --max-sequences) or other words")


def separability_from_features(features: dict[str, tuple[dict, np.ndarray]], *, site: str, classes: Sequence,
                               name: str, what: str, method: str = "logreg", seed: int = 0) -> Analysis:
    """Token separability per layer for each model, from {label: ({layer: (n, d)}, labels (n,))}."""
    from lime_probe.separability import token_separability

    rows, series, chance = [], {}, None
    for label, (per_layer, y) in features.items():
        res = token_separability(per_layer, y, method=method, seed=seed)
        chance = res.majority_baseline
        for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True):
            rows.append({"model": label, "site": site, "layer": layer, "accuracy_mean": float(m),
                         "accuracy_std": float(s), "majority_baseline": res.majority_baseline,
                         "n_rows": res.n_rows, "method": res.method})
        series[label] = {"layers": res.layers, "mean": res.accuracy_mean, "std": res.accuracy_std}
    shown = [str(c) for c in classes]
    return Analysis(
        name, f"Separability of {what}", rows,
        text=(f"Cross-validated accuracy (5 stratified folds, mean ± std) of a linear probe ({method}) telling apart "
              f"the {site} representations of {', '.join(repr(c) for c in shown)} at each layer, classes balanced. "
              "Chance is the majority-class rate; collapsed layers fall towards it."),
        figures={name: F.plot_separability(series, site=site, words=shown, chance=chance)},
        columns=("model", "layer", "accuracy_mean", "accuracy_std", "majority_baseline"))


def word_features(ck: Checkpoint, texts: Sequence[str], site: str, words: Sequence[str],
                  extract_kw: dict | None = None, minimum: int = 5) -> tuple[dict, np.ndarray]:
    """Representations of every occurrence of single-token ``words``: ({layer: (n, d)}, labels (n,)).

    ValueError if a word is not one token, or occurs fewer than ``minimum`` times in ``texts``.
    """
    from lime_probe.separability import word_rows, word_token_ids

    ids = word_token_ids(ck.tokenizer, words)
    acts = extract_site(ck, texts, site, extract_kw, token_ids=list(ids.values()))
    rows, y = word_rows(acts.token_ids, ids)
    check_class_counts(y, list(words), minimum, f"{ck.label}: words")
    return {layer: acts[site][layer][rows] for layer in acts[site]}, y


def separability_analysis(cks: Sequence[Checkpoint], texts: Sequence[str], *, site: str = "hidden",
                          words: Sequence[str] = DEFAULT_WORDS, method: str = "logreg", seed: int = 0,
                          extract_kw: dict | None = None) -> Analysis:
    """Separability of the occurrences of single-token ``words`` (paper Sec. 5.3, Figures 2b, 7b)."""
    features = {ck.label: word_features(ck, texts, site, words, extract_kw) for ck in cks}
    return separability_from_features(features, site=site, classes=words, name=f"separability_{site}",
                                      what="words", method=method, seed=seed)


def tsne_from_features(features: dict[str, tuple[dict, np.ndarray]], *, site: str, name: str, what: str,
                       per_class: int = 100, perplexity: float = 30.0, seed: int = 0) -> Analysis:
    """t-SNE maps per model and layer from {label: ({layer: (n, d)}, labels (n,))}, at most ``per_class``
    points of each class (seeded subsample, the same rows at every layer)."""
    from lime_probe.separability import balance_classes
    from lime_probe.tsne import tsne_layers

    rows, embeddings, point_labels = [], {}, {}
    for label, (per_layer, y) in features.items():
        y = np.asarray(y)
        n = min(per_class, int(np.unique(y, return_counts=True)[1].min()))
        keep = balance_classes(y, seed=seed, n_per_class=n)
        emb = tsne_layers({layer: X[keep] for layer, X in per_layer.items()}, perplexity=perplexity, seed=seed)
        embeddings[label], point_labels[label] = emb, [str(v) for v in y[keep]]
        for layer, xy in emb.items():
            rows += [{"model": label, "site": site, "layer": layer, "point": k, "token": point_labels[label][k],
                      "x": float(p[0]), "y": float(p[1])} for k, p in enumerate(xy)]
    return Analysis(
        name, f"t-SNE of {what}", rows,
        text=(f"openTSNE maps (perplexity {perplexity:g}, seed {seed}) of the {site} representations of {what}, "
              "one panel per model and layer, the same points in every panel. Separate clusters mean the layer "
              "keeps the tokens apart; a collapsed layer mixes them."),
        figures={name: F.plot_tsne_grid(embeddings, point_labels, site=site)},
        summary=[{"model": m, "layers": ",".join(str(la) for la in embeddings[m]),
                  "points_per_map": len(point_labels[m]), "tokens": " ".join(sorted(set(point_labels[m])))}
                 for m in embeddings])


def tsne_analysis(cks: Sequence[Checkpoint], texts: Sequence[str], *, site: str = "hidden",
                  words: Sequence[str] = DEFAULT_WORDS, per_word: int = 100, perplexity: float = 30.0,
                  seed: int = 0, extract_kw: dict | None = None) -> Analysis:
    """t-SNE of the occurrences of ``words`` per layer (paper Figures 3, 8)."""
    features = {ck.label: word_features(ck, texts, site, words, extract_kw) for ck in cks}
    return tsne_from_features(features, site=site, name=f"tsne_{site}", what="words", per_class=per_word,
                              perplexity=perplexity, seed=seed)


def cka_analysis(cks: Sequence[Checkpoint], texts: Sequence[str], *, site: str = "hidden", seed: int = 0,
                 extract_kw: dict | None = None) -> Analysis:
    """Linear CKA between every pair of layers and the effective rank of each layer (beyond the paper)."""
    from lime_probe.similarity import cka_matrix, effective_ranks

    rows, extra, figures, ranks = [], {}, {}, {}
    for ck in cks:
        acts = extract_site(ck, texts, site, extract_kw)
        layers = acts.layers(site)
        feats = {layer: acts[site][layer] for layer in layers}
        cka = cka_matrix(feats, progress=False)
        er = effective_ranks(feats, center=True, progress=False)
        for k, layer in enumerate(layers):
            rows.append({"model": ck.label, "site": site, "layer": layer, "effective_rank": float(er[k]),
                         "cka_with_previous": float(cka[k, k - 1]) if k else None,
                         "n_tokens": int(feats[layer].shape[0])})
        extra[ck.label] = {"layers": layers, "cka": cka, "effective_rank": er}
        ranks[ck.label] = {"layers": layers, "mean": er}
        figures[f"cka_{site}_{_slug(ck.label)}"] = F.plot_heatmap(
            cka, row_labels=layers, col_labels=layers, xlabel="layer", ylabel="layer", vmin=0.0, vmax=1.0,
            title=f"{ck.label}: linear CKA between layers ({site})", cbar_label="linear CKA")
    figures[f"effective_rank_{site}"] = F.plot_layer_curves(
        ranks, ylabel="effective rank (centred)", title=f"Effective rank of {site} per layer")
    return Analysis(
        f"cka_{site}", f"Layer similarity (CKA) and effective rank of {site}", rows,
        text=("Linear CKA between the token representations of every pair of layers (1 = the same up to rotation "
              "and scale), and the effective rank (exp of the entropy of the singular values) of each layer's "
              "centred token cloud."),
        extra={"cka": extra}, figures=figures,
        columns=("model", "layer", "effective_rank", "cka_with_previous"))


def router_analysis(cks: Sequence[Checkpoint], texts: Sequence[str] | None = None, *, seed: int = 0,
                    extract_kw: dict | None = None) -> Analysis:
    """LIMe router weights, layer x buffered layer and per head (paper Figures 5, 9).

    ``texts`` are needed only for routing "dynamic", whose weights depend on the token.
    """
    from lime_probe.router import router_weights

    rows, extra, figures = [], {}, {}
    for ck in cks:
        routing = getattr(ck.config, "routing", None)
        if routing in (None, "none"):
            raise ValueError(f"{ck.label} ({ck.source}) has no LIMe routers (routing {routing!r}); "
                             "the router analysis applies to LIMe checkpoints only")
        hidden = None
        if routing == "dynamic":
            if not texts:
                raise ValueError(f"{ck.label}: routing 'dynamic' depends on the input; give --data")
            acts = extract_site(ck, texts, "hidden", {**(extract_kw or {}), "layers": None})
            hidden = {layer: acts["hidden"][layer] for layer in acts["hidden"]}
        res = router_weights(ck.model, hidden)
        for i, src in enumerate(res.sources):
            for j in src:
                rows.append({"model": ck.label, "routing": res.routing, "layer": i, "source_layer": j,
                             "weight_share": float(res.per_layer[i, j])})
        extra[ck.label] = {"routing": res.routing, "per_layer": res.per_layer, "per_head": res.per_head,
                           "sources": res.sources}
        slug = _slug(ck.label)
        figures[f"router_{slug}"] = F.plot_router(res.per_layer, label=f"{ck.label} ({res.routing})")
        figures[f"router_heads_{slug}"] = F.plot_router_heads(res.per_head, label=f"{ck.label} ({res.routing})")
    return Analysis(
        "router", "Router weights", rows,
        text=("Normalised |router weight| of each layer over the buffered layers it reads (rows sum to 1), averaged "
              "over heads (first figure per model) and per KV head. Mass off the diagonal means the layer reads "
              "keys/values of earlier layers."),
        extra={"routers": extra}, figures=figures,
        columns=("model", "layer", "source_layer", "weight_share"))


def _is_causal_lm(ck: Checkpoint) -> bool:
    """False for BERT-style encoders (a masked-LM architecture not configured as a decoder): their
    attention is bidirectional, so summed next-token log-probabilities mean nothing."""
    import transformers as tf

    return bool(getattr(ck.config, "is_decoder", False)) or type(ck.config) not in tf.MODEL_FOR_MASKED_LM_MAPPING


def blimp_analysis(cks: Sequence[Checkpoint], data, *, site: str = "hidden", max_pairs: int = 200,
                   method: str = "logreg", seed: int = 0, extract_kw: dict | None = None) -> Analysis:
    """BLiMP per paradigm: good-vs-bad probes per layer (paper Table 2, Appendix D) and, for causal LMs,
    minimal-pair scoring (lm-evaluation-harness's rule). ``data`` is a ``load_blimp`` dataset."""
    from lime_probe.blimp import blimp_probe, score_minimal_pairs

    uids = np.asarray(data["UID"], dtype=object)
    paradigms = sorted(set(uids))
    rows, summary, extra, figures = [], [], {}, {}
    for ck in cks:
        curves, scores = {}, None
        picked = {p: np.flatnonzero(uids == p)[:max_pairs] for p in paradigms}
        if _is_causal_lm(ck):
            scores = score_minimal_pairs(ck.model, ck.tokenizer, data.select(np.concatenate(list(picked.values()))),
                                         progress=False)
            extra[ck.label] = {"minimal_pairs": {"per_paradigm": scores.per_paradigm,
                                                 "per_phenomenon": scores.per_phenomenon,
                                                 "mean_over_paradigms": scores.mean_over_paradigms,
                                                 "mean_over_phenomena": scores.mean_over_phenomena}}
        for p in paradigms:
            part = data.select(picked[p])
            good = extract_site(ck, list(part["sentence_good"]), site, extract_kw, pool="mean")
            bad = extract_site(ck, list(part["sentence_bad"]), site, extract_kw, pool="mean")
            res = blimp_probe({la: good[site][la] for la in good[site]}, {la: bad[site][la] for la in bad[site]},
                              np.asarray(part["pairID"]), method=method, seed=seed, progress=False)
            for layer, m, s in zip(res.layers, res.accuracy_mean, res.accuracy_std, strict=True):
                rows.append({"model": ck.label, "paradigm": p, "site": site, "layer": layer,
                             "probe_accuracy_mean": float(m), "probe_accuracy_std": float(s), "n_pairs": len(part)})
            curves[p] = {"layers": res.layers, "mean": res.accuracy_mean, "std": res.accuracy_std}
            best = int(np.argmax(res.accuracy_mean))
            summary.append({"model": ck.label, "paradigm": p, "best_layer": res.layers[best],
                            "probe_accuracy": float(res.accuracy_mean[best]),
                            "minimal_pair_accuracy": scores.per_paradigm[p] if scores else None})
        figures[f"blimp_{site}_{_slug(ck.label)}"] = F.plot_blimp_layers(curves, model=ck.label, site=site)
    models = [ck.label for ck in cks]
    best = np.array([[next(r["probe_accuracy"] for r in summary if r["model"] == m and r["paradigm"] == p)
                      for m in models] for p in paradigms])
    figures[f"blimp_{site}_best_layer"] = F.plot_heatmap(
        best, row_labels=paradigms, col_labels=models, xlabel="model", ylabel="paradigm", vmin=0.5, vmax=1.0,
        title=f"BLiMP probe accuracy at the best layer ({site})", cbar_label="probe accuracy")
    return Analysis(
        f"blimp_{site}", "BLiMP probes and minimal pairs", rows,
        text=(f"Per paradigm (at most {max_pairs} pairs each): a logistic-regression probe telling the mean-pooled "
              f"{site} representation of the good sentence from the bad one, 5-fold CV grouped by pair, per layer; "
              "and, for causal LMs, minimal-pair accuracy (summed log-probabilities after the BOS token, good > bad, "
              "as lm-evaluation-harness). The mean over paradigms and over phenomena are both in the JSON."),
        extra={"blimp": extra}, figures=figures, summary=summary)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in label)


ANALYSES: dict[str, Callable] = {"entropy": entropy_analysis, "separability": separability_analysis,
                                 "tsne": tsne_analysis, "cka": cka_analysis, "router": router_analysis}


# --------------------------------------------------------------------------- output


@contextmanager
def staged_output(out: str | os.PathLike):
    """Yield a fresh temp folder beside ``out``; on success move its files into ``out``.

    On any exception (including KeyboardInterrupt) the temp folder is removed and ``out`` is
    left as it was. Raises ValueError if ``out`` is a file and PermissionError if it cannot be
    written.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise FileNotFoundError(f"--out {out}: parent folder {parent} does not exist")
    if not os.access(out if out.exists() else parent, os.W_OK | os.X_OK):
        raise PermissionError(f"--out {out} is not writable")
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=parent))
    except OSError as e:
        raise PermissionError(f"--out {out} is not writable ({e.strerror})") from None
    try:
        yield tmp
        if not out.exists():
            os.replace(tmp, out)
            return
        for item in sorted(tmp.rglob("*")):
            target = out / item.relative_to(tmp)
            if item.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def format_table(rows: Sequence[dict], columns: Sequence[str] = ()) -> str:
    """A compact fixed-width text table of ``rows`` (floats to 4 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(columns) or list(dict.fromkeys(k for r in rows for k in r))

    def cell(v):
        if isinstance(v, float | np.floating):
            return f"{v:.4g}"
        return "" if v is None else str(v)

    cells = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    # numbers right-aligned, text left-aligned
    numeric = [all(isinstance(r.get(c), int | float | np.number) or r.get(c) is None for r in rows) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(row, widths, numeric, strict=True))
              for row in cells]
    return "\n".join(lines)


def write_analysis(a: Analysis, out: Path, meta: dict) -> None:
    """Write an analysis's results (JSON + CSV) and figures (PNG + PDF) into ``out``."""
    write_results(out / a.name, a.rows, meta=meta, extra=a.extra)
    for stem, fig in a.figures.items():
        F.save_figure(fig, out / stem)


# --------------------------------------------------------------------------- commands


def run_analysis(name: str, cks: Sequence[Checkpoint], texts: Sequence[str] | None, args) -> Analysis:
    """Call analysis ``name`` with the options of ``args`` that its signature names."""
    fn = ANALYSES[name]
    names = [p for p in inspect.signature(fn).parameters if p not in ("cks", "texts", "extract_kw")]
    kw = {p: getattr(args, p) for p in names if hasattr(args, p)}
    return fn(cks, texts, extract_kw=extract_options(args) if texts is not None else None, **kw)


def section_for(a: Analysis) -> Section:
    """The report section of an analysis: its text, figures and compact table."""
    return Section(a.title, text=a.text, figures=list(a.figures.values()), tables=[Table(a.title, a.table())])


def _meta(command: str, args, cks: Sequence[Checkpoint]) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("handler", "debug")}
    return run_metadata(command, settings=settings, checkpoints={c.label: c.source for c in cks})


def _analysis_command(name: str):
    def handler(args, out: Path) -> None:
        texts = load_texts(args.data, args.max_sequences) if args.data is not None else None
        cks = load_checkpoints(args.ckpt, args.label, args.device)
        a = run_analysis(name, cks, texts, args)
        write_analysis(a, out, _meta(name, args, cks))
        print(format_table(a.table()))

    return handler


def cmd_report(args, out: Path) -> None:
    """Run the chosen analyses on every checkpoint and write one self-contained HTML report."""
    texts = load_texts(args.data, args.max_sequences)
    cks = load_checkpoints(args.ckpt, args.label, args.device)
    meta = _meta("report", args, cks)
    sections = []
    for name in args.analyses:
        chosen = cks
        if name == "router":  # only LIMe checkpoints have routers
            chosen = [c for c in cks if getattr(c.config, "routing", "none") != "none"]
            if not chosen:
                continue
        a = run_analysis(name, chosen, texts, args)
        write_analysis(a, out, meta)
        sections.append(section_for(a))
        print(f"\n{a.title}\n{format_table(a.table())}")
    labels = " vs ".join(c.label for c in cks)
    write_report(out / "report.html", f"lime-probe report: {labels}", sections, meta=meta)


def cmd_blimp(args, out: Path) -> None:
    """BLiMP probes and minimal-pair scoring for every checkpoint."""
    from lime_probe.blimp import load_blimp

    data = load_blimp(args.data, args.paradigms)
    cks = load_checkpoints(args.ckpt, args.label, args.device)
    a = blimp_analysis(cks, data, site=args.site, max_pairs=args.max_pairs, method=args.method, seed=args.seed,
                       extract_kw=extract_options(args))
    write_analysis(a, out, _meta("blimp", args, cks))
    print(format_table(a.table()))


def cmd_demo(args, out: Path) -> None:
    """Train tiny LIMe and LLaMA models on arithmetic and run every analysis (``lime_probe.demo``)."""
    from lime_probe.demo import run_demo

    run_demo(out, quick=args.quick, seed=args.seed, device=args.device, runs=args.runs)


# --------------------------------------------------------------------------- parser


EXAMPLES = {
    "entropy": "lime-probe entropy --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
               "    --data wikitext-2/valid.txt --site values --max-sequences 64 --out out/entropy",
    "separability": "lime-probe separability --ckpt runs/lime --ckpt runs/llama --data wikitext-2/valid.txt \\\n"
                    "    --words ' is' ' are' ' was' ' were' --site values --max-sequences 2000 --out out/sep",
    "tsne": "lime-probe tsne --ckpt runs/lime --ckpt runs/llama --data wikitext-2/valid.txt --layers 0,4,8,12 \\\n"
            "    --per-word 150 --out out/tsne",
    "blimp": "lime-probe blimp --ckpt runs/lime --ckpt runs/llama --data shared/data/blimp \\\n"
             "    --paradigms anaphor_gender_agreement adjunct_island --max-pairs 500 --out out/blimp",
    "cka": "lime-probe cka --ckpt runs/lime --data wikitext-2/valid.txt --site hidden --max-tokens 2000 --out out/cka",
    "router": "lime-probe router --ckpt runs/lime --label LIMe --out out/router",
    "report": "lime-probe report --ckpt runs/lime --ckpt runs/llama --label LIMe --label LLaMA \\\n"
              "    --data wikitext-2/valid.txt --max-sequences 256 --out out/report   # then open out/report/report.html",
    "demo": "lime-probe demo                 # about 2 minutes on 2 CPU cores, writes figures/\n"
            "lime-probe demo --quick --out /tmp/demo   # a 1-minute smoke run",
}

HELP = {
    "entropy": "matrix-based Renyi entropy per layer (paper Sec. 5.3, Figures 2a/4a/7a)",
    "separability": "linear-probe separability of word occurrences per layer (paper Figures 2b/7b)",
    "tsne": "t-SNE maps of word occurrences, models x layers (paper Figures 3/8)",
    "blimp": "BLiMP good-vs-bad probes per layer and minimal-pair scoring (paper Table 2)",
    "cka": "linear CKA between layers and effective rank per layer",
    "router": "LIMe router weights, layer x buffered layer and per head (paper Figures 5/9)",
    "report": "run several analyses and write one self-contained HTML report",
    "demo": "train tiny LIMe and LLaMA models on arithmetic, offline, and run every analysis",
}


def _checkpoint_options(p: argparse.ArgumentParser, *, data: str) -> None:
    """--ckpt/--label and, unless ``data`` is "none", --data ("required", "optional" or "blimp") and the
    size limits."""
    g = p.add_argument_group("checkpoints and data")
    g.add_argument("--ckpt", action="append", required=True, metavar="PATH|HUB_ID",
                   help="checkpoint directory or hub id; repeat to compare side by side")
    g.add_argument("--label", action="append", metavar="NAME",
                   help="name per --ckpt in tables and legends (default: the folder name)")
    if data == "none":
        return
    if data == "blimp":
        g.add_argument("--data", default="nyu-mll/blimp", metavar="SPEC",
                       help="a folder of BLiMP <paradigm>.jsonl files, one .jsonl file, or the hub id nyu-mll/blimp "
                            "(default: %(default)s, needs a network)")
    else:
        g.add_argument("--data", required=data == "required", metavar="SPEC",
                       help="a .txt/.jsonl/.parquet file or folder, or hf:NAME[:CONFIG][:SPLIT]"
                            + ("" if data == "required" else " (only for routing 'dynamic')"))
    if data != "blimp":  # BLiMP is limited per paradigm by --max-pairs
        g.add_argument("--max-sequences", type=_positive, default=64, metavar="N",
                       help="use at most N sequences (default: %(default)s)")
    g.add_argument("--max-length", type=_positive, default=256, metavar="T",
                   help="truncate each sequence to T tokens (default: %(default)s)")
    g.add_argument("--max-tokens", type=_positive, default=None, metavar="N",
                   help="stop extracting after N tokens in all (default: no limit)")
    g.add_argument("--batch-size", type=_positive, default=8, metavar="B",
                   help="sequences per forward pass (default: %(default)s)")
    g.add_argument("--cache", default=_default_cache(), metavar="DIR",
                   help="activation cache; a rerun or an interrupted run reuses it (default: %(default)s)")
    g.add_argument("--no-cache", dest="cache", action="store_const", const=None,
                   help="extract without the on-disk cache")


def _run_options(p: argparse.ArgumentParser, out: str = "lime-probe-out") -> None:
    r = p.add_argument_group("run")
    r.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: %(default)s)")
    r.add_argument("--out", default=out, metavar="DIR", help="folder for results and figures (default: %(default)s)")
    r.add_argument("--seed", type=int, default=0, help="seed for sampling, folds, t-SNE (default: %(default)s)")
    r.add_argument("--debug", action="store_true", help="show the full traceback on failure")


def _default_cache() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "lime-probe")


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _site_options(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--site", default=default, choices=SITES, help="representation to probe (default: %(default)s)")
    p.add_argument("--layers", default="all", help="'all' or comma-separated layer indices (default: all)")


def _entropy_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="lime", choices=("lime", "layer-by-layer"),
                   help="normalisation preset: the official code's or Skean et al.'s (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=None, help="Renyi order (default: the preset's)")


def _word_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--words", nargs="+", default=list(DEFAULT_WORDS), metavar="WORD",
                   help="single-token words to tell apart, leading spaces included (default: ' is' ' are' ' was' ' were')")
    p.add_argument("--method", default="logreg", choices=("logreg", "adam-linear"),
                   help="probe: converged logistic regression (paper text) or the official one-epoch Adam "
                        "linear layer (default: %(default)s)")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (the usage itself stays one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``lime-probe`` argument parser with one subcommand per analysis."""
    parser = _Parser(prog=PROG, description="The LIMe paper's analyses of representation collapse.",
                     epilog="Run 'lime-probe COMMAND --help' for a command's options and an example.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def add(name: str, handler: Callable, data: str = "required") -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=HELP[name], description=HELP[name],
                           epilog="example:\n" + textwrap.indent(EXAMPLES[name], "  "),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name != "demo":
            _checkpoint_options(p, data=data)
        _run_options(p, out="figures" if name == "demo" else "lime-probe-out")
        p.set_defaults(handler=handler)
        return p

    p = add("entropy", _analysis_command("entropy"))
    _site_options(p, "values")
    _entropy_options(p)

    p = add("separability", _analysis_command("separability"))
    _site_options(p, "hidden")
    _word_options(p)

    p = add("tsne", _analysis_command("tsne"))
    _site_options(p, "hidden")
    _word_options(p)
    p.add_argument("--per-word", type=_positive, default=100, metavar="N",
                   help="points per word in each map (default: %(default)s)")
    p.add_argument("--perplexity", type=float, default=30.0, help="t-SNE perplexity (default: %(default)s)")

    p = add("blimp", cmd_blimp, data="blimp")
    _site_options(p, "hidden")
    p.add_argument("--paradigms", nargs="+", default=None, metavar="UID",
                   help="BLiMP paradigms to use (default: all in --data)")
    p.add_argument("--max-pairs", type=_positive, default=200, metavar="N",
                   help="minimal pairs per paradigm (default: %(default)s; BLiMP has 1,000)")
    p.add_argument("--method", default="logreg", choices=("logreg", "adam-linear"),
                   help="probe (default: %(default)s)")

    p = add("cka", _analysis_command("cka"))
    _site_options(p, "hidden")

    add("router", _analysis_command("router"), data="optional")

    p = add("report", cmd_report)
    _site_options(p, "values")
    _entropy_options(p)
    _word_options(p)
    p.add_argument("--analyses", nargs="+", default=list(ANALYSES), choices=list(ANALYSES),
                   help="analyses to include; router only for LIMe checkpoints (default: all)")

    p = add("demo", cmd_demo)
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (about a minute) instead of the real demo")
    p.add_argument("--runs", default=None, metavar="DIR",
                   help="keep the two training runs here and reuse finished ones (default: a temporary folder)")
    return parser


def _one_line(e: BaseException) -> str:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(msg.split()) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, run the command, map errors to exit codes (see module doc)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or bad usage (2), message already printed
        return int(e.code or 0)
    where = f"{PROG} {args.command}"
    try:
        with staged_output(args.out) as tmp:
            args.handler(args, tmp)
    except KeyboardInterrupt:
        print(f"{where}: interrupted; nothing was written to {args.out}", file=sys.stderr)
        return 130
    except BAD_INPUT as e:
        if args.debug:
            raise
        print(f"{where}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        print(f"{where}: failed: {type(e).__name__}: {_one_line(e)} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1
    print(f"results in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
