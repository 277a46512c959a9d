"""Collapse metrics per layer, as the literature defines them (`lime_probe.probes.collapse`): TwoNN intrinsic
dimension, effective rank, Diff-eRank, trajectory curvature, dataset entropy, LiDAR and the angular distance
between layers (beyond the LIMe paper).

Every metric is measured at one site on each layer of each checkpoint. The token rows feed TwoNN (at most
``twonn_points`` of them, drawn with the seed: its cost grows with their square) and the effective rank; the
sequences feed the curvature, Diff-eRank and the dataset entropy. Diff-eRank compares the checkpoint with the
same architecture untrained: a lime-model run folder's own step 0 (its recipe's seed rebuilds it), otherwise a
fresh initialisation with ``--seed``. LiDAR reads each text in ``augmentations`` augmented views (`augment_text`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lime_probe.extraction.settings import Extraction
from lime_probe.extraction.sites import check_site

from .base import (
    SITE_HELP,
    Checkpoint,
    Result,
    Spec,
    curve,
    extract_site,
    group,
    option,
    seed_option,
    slug,
)

METRICS = (
    "twonn",
    "effective-rank",
    "diff-erank",
    "curvature",
    "dataset-entropy",
    "lidar",
    "angular-distance",
)
LABELS = {
    "twonn": "intrinsic dimension (TwoNN)",
    "effective-rank": "effective rank (centred tokens)",
    "diff-erank": "Diff-eRank (untrained - trained eRank)",
    "curvature": "curvature (radians)",
    "dataset-entropy": "dataset entropy (nats)",
    "lidar": "LiDAR entropy (nats)",
    "angular-distance": "angular distance to layer l + n",
}

# The augmentations of Skean et al.'s code are nlpaug's SplitAug, RandomCharAug (substitute) and KeyboardAug in
# sequence, each touching 30 % of the words of at least 4 characters and 30 % of their characters (nlpaug's
# defaults); `augment_text` is ours, after those three kinds and rates.
AUG_P, AUG_MIN_CHARS = 0.3, 4
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"
_KEY_ROWS = ("1234567890", "qwertyuiop", "asdfghjkl", "zxcvbnm")


def _keyboard_neighbours() -> dict[str, str]:
    """Each key of a QWERTY keyboard -> the keys beside, above and below it."""
    out = {}
    for r, row in enumerate(_KEY_ROWS):
        for c, key in enumerate(row):
            near = [row[c + dc] for dc in (-1, 1) if 0 <= c + dc < len(row)]
            for other in (_KEY_ROWS[r - 1] if r else "", _KEY_ROWS[r + 1] if r + 1 < len(_KEY_ROWS) else ""):
                near += [other[k] for k in (c - 1, c, c + 1) if 0 <= k < len(other)]
            out[key] = "".join(near)
    return out


KEYBOARD = _keyboard_neighbours()


def _typo(word: str, rng: random.Random, keyboard: bool) -> str:
    """``word`` with some characters replaced: by a random letter or digit, or by a keyboard neighbour."""
    if len(word) < AUG_MIN_CHARS or rng.random() >= AUG_P:
        return word
    chars = []
    for ch in word:
        near = KEYBOARD.get(ch.lower(), "") if keyboard else _ALNUM
        if near and rng.random() < AUG_P:
            new = rng.choice(near)
            ch = new.upper() if ch.isupper() else new
        chars.append(ch)
    return "".join(chars)


def augment_text(text: str, rng: random.Random) -> str:
    """One augmented view of ``text`` (ours, after Skean et al.'s three nlpaug augmentations): words split in
    two at a random point, then characters substituted at random, then keyboard typos."""
    words = []
    for w in text.split(" "):
        if len(w) >= AUG_MIN_CHARS and rng.random() < AUG_P:
            k = rng.randrange(1, len(w))
            words += [w[:k], w[k:]]
        else:
            words.append(w)
    for keyboard in (False, True):
        words = [_typo(w, rng, keyboard) for w in words]
    return " ".join(words)


@dataclass(frozen=True)
class MetricsParams:
    metric: str = option(
        "all",
        "the metric: twonn (intrinsic dimension), effective-rank, diff-erank (against the untrained model), "
        "curvature (of token trajectories), dataset-entropy, lidar (over augmented views), angular-distance "
        "(layer l to l + --shift), or all",
        choices=("all", *METRICS),
        metavar="NAME",
    )
    site: str = option("hidden", f"representation to measure: {SITE_HELP}", type=check_site, metavar="SITE")
    twonn_method: str = option(
        "fit",
        "TwoNN estimator: Facco et al.'s line fit with the largest 10%% of ratios left out, or the MLE",
        choices=("fit", "mle"),
    )
    twonn_points: int = option(
        4000,
        "TwoNN: token rows used at most, drawn with --seed (ours: its cost is quadratic)",
        metavar="N",
        positive=True,
    )
    curvature_form: str = option(
        "defining",
        "curvature as Hosseini & Fedorenko define it (angles in [0, pi] of the raw tokens) or as Skean et "
        "al.'s code computes it (tokens centred and L2-normalised, angles of |cos|, in [0, pi/2])",
        choices=("defining", "layer-by-layer"),
    )
    alpha: float = option(1.0, "Renyi order of the dataset entropy and LiDAR")
    augmentations: int = option(
        16, "LiDAR: augmented views of each text (Skean et al.'s code: 16)", metavar="A", positive=True
    )
    shift: int = option(1, "angular distance: layer l against layer l + N", metavar="N", positive=True)
    last_token: bool = option(
        False, "angular distance of each sequence's last token only (as Gromov et al.), not every token"
    )
    seed: int = seed_option()

    def __post_init__(self) -> None:
        from lime_model.checks import check_positive

        check_positive(self.alpha, "--alpha")
        for name in ("twonn_points", "augmentations", "shift"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.augmentations < 2 and self.metric in ("all", "lidar"):
            raise ValueError("--augmentations: LiDAR needs at least 2 views of each text")


def untrained(ck: Checkpoint, seed: int) -> Checkpoint:
    """``ck``'s architecture untrained: its run's own step 0 where its folder names the seed, else initialised
    with ``seed``."""
    from lime_probe.extraction.loading import wrap
    from lime_probe.probes.router_weights import run_seed, step0_model

    own = run_seed(ck.source)
    weight = next(getattr(ck.model, "_module", ck.model).parameters())
    # a Hugging Face model, where the checkpoint runs and in its dtype
    fresh: Any = step0_model(ck.model, seed if own is None else own).to(weight.device, weight.dtype)
    return Checkpoint(f"{ck.label} (untrained)", ck.source, wrap(fresh, ck.tokenizer), ck.tokenizer)


def _values(ck: Checkpoint, texts: Sequence[str], p: MetricsParams, extraction: Extraction) -> list[dict]:
    """One row per metric and layer of ``ck``."""
    import torch

    from lime_probe.probes import collapse as C
    from lime_probe.probes.similarity import effective_rank

    chosen = METRICS if p.metric == "all" else (p.metric,)
    acts = extract_site(ck, texts, p.site, extraction)
    layers = acts.layers(p.site)
    seqs = {la: [z.double() for z in acts.sequences(p.site, la)] for la in layers}
    rows = []

    def row(metric: str, layer: int, value: float, n: int, layer_to: int | None = None) -> None:
        rows.append(
            {
                "model": ck.label,
                "site": p.site,
                "metric": metric,
                "layer": layer,
                "value": value,
                "n": n,
                "layer_to": layer_to,
            }
        )

    gen = torch.Generator().manual_seed(p.seed)
    for la in layers if "twonn" in chosen else []:
        X = torch.cat(seqs[la])
        X = X[torch.randperm(len(X), generator=gen)[: p.twonn_points]]
        row("twonn", la, C.intrinsic_dimension(X, p.twonn_method), len(X))
    for la in layers if "effective-rank" in chosen else []:
        X = torch.cat(seqs[la])
        row("effective-rank", la, effective_rank(X, center=True), len(X))
    if "diff-erank" in chosen:
        # a fresh model: nothing to reuse
        base = extract_site(untrained(ck, p.seed), texts, p.site, extraction, cache_dir=None)
        for la in layers:
            # a one-token sequence has no covariance once centred
            pairs = [
                (u.double(), z)
                for u, z in zip(base.sequences(p.site, la), seqs[la], strict=True)
                if len(z) > 1
            ]
            if not pairs:
                raise ValueError("diff-erank: every sequence is one token long; give longer texts")
            row("diff-erank", la, C.diff_erank(*zip(*pairs, strict=True)), len(pairs))
    for la in layers if "curvature" in chosen else []:
        defining = p.curvature_form == "defining"
        trajectories = seqs[la] if defining else [C.center_l2(z) for z in seqs[la]]
        row("curvature", la, C.mean_curvature(trajectories, absolute=not defining), len(trajectories))
    for la in layers if "dataset-entropy" in chosen else []:
        row("dataset-entropy", la, C.dataset_entropy(seqs[la], alpha=p.alpha), len(seqs[la]))
    if "lidar" in chosen:
        rng = random.Random(p.seed)
        views_texts = [augment_text(t, rng) for t in texts for _ in range(p.augmentations)]
        views = extract_site(ck, views_texts, p.site, extraction)
        for la in layers:
            pooled = C.pooled(views.sequences(p.site, la))
            complete = len(pooled) // p.augmentations  # a --max-tokens budget may cut the last text's views
            V = pooled[: complete * p.augmentations].reshape(complete, p.augmentations, -1)
            row("lidar", la, C.lidar(V, alpha=p.alpha), complete)
    if "angular-distance" in chosen:
        pick = (lambda zs: torch.stack([z[-1] for z in zs])) if p.last_token else torch.cat
        feats = {la: pick(seqs[la]) for la in layers}
        for la, d in C.layer_angular_distances(feats, p.shift).items():
            row("angular-distance", la, d, len(feats[la]), la + p.shift)
    return rows


def compute(
    cks: Sequence[Checkpoint], texts: Sequence[str], p: MetricsParams, extraction: Extraction
) -> Result:
    """Each chosen metric on every layer of each checkpoint at ``p.site``: one row per model, metric and layer
    with its value and the number of rows (tokens, sequences or samples) it was computed on."""
    texts = list(texts)
    if not texts:
        raise ValueError("metrics: no texts given")
    rows = [r for ck in cks for r in _values(ck, texts, p, extraction)]
    if not rows:
        raise ValueError(f"--shift {p.shift}: no two extracted layers are {p.shift} apart")
    measured = ", ".join(LABELS[m] for m in group(rows, "metric"))
    return Result(
        "metrics",
        f"metrics_{slug(p.metric)}_{slug(p.site)}",
        f"Collapse metrics of {p.site}",
        rows,
        text=(
            f"Per layer of {p.site}: {measured}. Formulas and sources in docs/probes.md (collapse metrics); "
            f"Diff-eRank compares each checkpoint with its architecture untrained, LiDAR reads "
            f"{p.augmentations} augmented views of each text, the angular distance is layer l to l + {p.shift}"
            + (" at each sequence's last token." if p.last_token else ", averaged over tokens.")
        ),
        columns=("model", "metric", "layer", "value", "n"),
    )


def plot(result: Result) -> dict:
    from lime_probe.output import charts as C
    from lime_probe.output import plots as F

    site = result.rows[0]["site"]
    return {
        f"{slug(metric)}_{slug(site)}": C.plot_layer_curves(
            {m: curve(rs, "value") for m, rs in group(in_metric, "model").items()},
            ylabel=LABELS[metric],
            title=f"{LABELS[metric]} of {site} per layer",
            xlabel=F.layer_axis_label(site),
        )
        for metric, in_metric in group(result.rows, "metric").items()
    }


SPEC = Spec(
    name="metrics",
    help="collapse metrics per layer: TwoNN intrinsic dimension, effective rank, Diff-eRank, curvature, "
    "dataset entropy, LiDAR, angular distance between layers",
    example="lime-probe metrics --ckpt runs/lime --data data/wikitext-2/valid.txt --metric twonn --out out/twonn\n"
    "lime-probe metrics --ckpt runs/lime --ckpt runs/llama --data data/wikitext-2/valid.txt --metric all \\\n"
    "    --max-sequences 32 --max-length 128 --out out/metrics",
    params=MetricsParams,
    compute=compute,
    plot=plot,
    in_report=False,  # Diff-eRank builds a second model and LiDAR reads every text 16 times
)
