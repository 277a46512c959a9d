"""Line and bar charts in the package style (`plots`), drawn from plain arrays and dicts: the per-layer curves
of the probes (entropy, logit lens, separability, BLiMP per layer) and the figures of training runs and studies
(loss curves, accuracy by operator count, BLiMP summary bars, bars, forest plots of intervals). The maps
(heatmaps, router weights, t-SNE grids), the style and `save_figure` are in `plots`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lime_probe.output.plots import (
    LINESTYLES,
    _as_1d,
    _new_figure,
    color,
    layer_axis_label,
    line_style,
    style,
)


def plot_layer_curves(
    series: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    ylabel: str,
    title: str,
    xlabel: str = "layer",
    baseline: float | None = None,
    baseline_label: str = "chance",
    ax=None,
) -> Figure:
    """One line per model over layers, with an optional shaded band.

    ``series[label]`` holds ``"mean"`` (n_layers,) and optionally ``"layers"`` (n_layers,;
    default 0..n-1) and a band: either ``"low"``/``"high"`` (e.g. a 95 % CI) or ``"std"``
    (drawn as mean +- std). ``baseline`` draws a dashed horizontal reference line.
    """
    if not series:
        raise ValueError("plot_layer_curves needs at least one series")
    with style():
        if ax is None:
            fig, axes = _new_figure()
            ax = axes[0, 0]
        fig = ax.figure
        low: np.ndarray | None
        high: np.ndarray | None
        for i, (label, s) in enumerate(series.items()):
            mean = _as_1d(f"{label} mean", s["mean"])
            layers = _as_1d(f"{label} layers", s.get("layers", np.arange(len(mean))))
            if "low" in s and "high" in s:
                low, high = _as_1d(f"{label} low", s["low"]), _as_1d(f"{label} high", s["high"])
            elif "std" in s:
                std = _as_1d(f"{label} std", s["std"])
                low, high = mean - std, mean + std
            else:
                low = high = None
            ax.plot(layers, mean, **line_style(i), label=label)
            if low is not None:
                ax.fill_between(layers, low, high, color=color(i), alpha=0.2, linewidth=0)
        if baseline is not None:
            ax.axhline(baseline, color="0.4", linestyle=":", linewidth=1.2, label=baseline_label)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    return fig


def plot_entropy(
    series: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    site: str,
    alpha: float | None = None,
    band: str | None = None,
) -> Figure:
    """Matrix entropy per layer for several models (paper Figures 2a, 4a, 7a); see ``plot_layer_curves``.
    ``band`` says in the title what the series' bands are (e.g. "95 % bootstrap CI over sequences").

    Entropies of different models often differ by a few percent of their size, so the automatic
    y-axis starts far above zero and makes small gaps look large. When the axis shows less than
    half of the range from zero, a note under the plot says where it starts and gives the largest
    gap between the first two models, with an interval only where seeds pair them (see `gap_note`).
    The legend sits right of the plot, never over the curves; the band's words go on a line of their own
    under the title, which stays within the plot's width.
    """
    order = f" (α={alpha:g})" if alpha is not None else ""
    fig = plot_layer_curves(
        series,
        ylabel=f"matrix entropy{order} [nats]",
        title=f"Entropy of {site} per layer" + ("\n" + textwrap.fill(f"band: {band}", 44) if band else ""),
        xlabel=layer_axis_label(site),
    )
    ax = fig.axes[0]
    bottom, top = ax.get_ylim()
    if bottom > 0 and top - bottom < top / 2:
        with style():
            fig.supxlabel(textwrap.fill(gap_note(series, bottom), 70), fontsize=8, color="0.3")
    _legend_beside(fig)
    return fig


def _legend_beside(fig: Figure, **kw: Any) -> None:
    """Move the legend of ``fig``'s one axes to the right of the plot, in columns of at most `LEGEND_ROWS`
    entries, and widen the figure by its width, so the plotting area keeps its size (a legend inside the
    axes covers curves; one larger than them leaves constrained layout no room)."""
    ax = fig.axes[0]
    handles, names = ax.get_legend_handles_labels()
    if (legend := ax.get_legend()) is not None:
        legend.remove()
    with style():
        legend = fig.legend(
            handles, names, loc="outside right center", ncols=-(-len(names) // LEGEND_ROWS), **kw
        )
        width = legend.get_window_extent().width / fig.dpi
        fig.set_size_inches(fig.get_figwidth() + width + 0.2, fig.get_figheight())


def plot_logit_lens(
    cross_entropy: Mapping[str, Mapping[str, Sequence[float]]],
    agreement: Mapping[str, Mapping[str, Sequence[float]]],
    *,
    band: str | None = None,
) -> Figure:
    """The logit lens per layer, side by side: next-token cross-entropy and top-1 agreement with the model's own
    prediction, one line per model (series as in ``plot_layer_curves``), on the residual stream's layer axis
    (as the entropy curve of ``hidden``). ``band`` says in the titles what the bands are."""
    with style():
        fig, axes = _new_figure(2)
    suffix = f"\nband: {band}" if band else ""
    xlabel = layer_axis_label("hidden")
    plot_layer_curves(
        cross_entropy,
        ylabel="next-token cross-entropy [nats]",
        title="Logit lens: loss of each layer" + suffix,
        xlabel=xlabel,
        ax=axes[0, 0],
    )
    plot_layer_curves(
        agreement,
        ylabel="top-1 agreement with the model's prediction",
        title="Logit lens: agreement with the last layer" + suffix,
        xlabel=xlabel,
        ax=axes[0, 1],
    )
    axes[0, 1].set_ylim(-0.02, 1.02)
    return fig


def gap_note(series: Mapping[str, Mapping[str, Sequence[float]]], bottom: float) -> str:
    """ "y-axis starts at `bottom`, not 0" and, for two or more series, the largest gap between the
    first two at a shared layer: ``A − B = d nats (x % of B)``.

    The gap gets an interval only where both series give ``"seeds"`` ``(n_seeds, n_layers)``, the
    per-seed values of the same n >= 2 seeds in the same order: the 95 % paired t-interval over seeds
    (`lime_probe.probes.stats.paired_difference`), labelled so. Otherwise (single runs, or seeds that do not
    pair) the note says there is none: the two models' own bands (over sequences, or min-max over
    seeds) are no interval for their difference.
    """
    note = f"y-axis starts at {bottom:.3g}, not 0"
    if len(series) < 2:
        return note
    (name_a, a), (name_b, b) = list(series.items())[:2]
    mean_a, mean_b = _as_1d(f"{name_a} mean", a["mean"]), _as_1d(f"{name_b} mean", b["mean"])
    layers_a = list(_as_1d(f"{name_a} layers", a.get("layers", np.arange(len(mean_a)))))
    layers_b = list(_as_1d(f"{name_b} layers", b.get("layers", np.arange(len(mean_b)))))
    shared = [la for la in layers_a if la in layers_b]
    if not shared:
        return note
    ia, ib = zip(*[(layers_a.index(la), layers_b.index(la)) for la in shared], strict=True)
    diff = mean_a[list(ia)] - mean_b[list(ib)]
    k = int(np.argmax(np.abs(diff)))
    i, j = ia[k], ib[k]
    text = f"{note}; largest gap at layer {shared[k]:g}: {name_a} − {name_b} = {diff[k]:+.3g} nats"
    text += f" ({diff[k] / mean_b[j]:+.1%} of {name_b})"
    seeds_a, seeds_b = (np.asarray(s["seeds"], float) if "seeds" in s else None for s in (a, b))
    if seeds_a is None or seeds_b is None or seeds_a.shape[0] != seeds_b.shape[0] or seeds_a.shape[0] < 2:
        return text + "; no interval (not paired over two or more seeds)"
    from lime_probe.probes.stats import paired_difference

    d = paired_difference(seeds_a[:, i], seeds_b[:, j])
    return text + f", 95 % paired t-interval over {d.n} seeds [{d.ci_low:+.3g}, {d.ci_high:+.3g}]"


def plot_separability(
    series: Mapping[str, Mapping[str, Sequence[float]]], *, site: str, words: Sequence[str], chance: float
) -> Figure:
    """Linear-probe accuracy per layer, mean +- std over folds (paper Figures 2b, 7b).

    Curves often run along 1.0, so the legend sits below the plot, never over the lines.
    """
    shown = ", ".join(repr(w) for w in words)
    fig = plot_layer_curves(
        series,
        ylabel="probe accuracy",
        baseline=chance,
        baseline_label="majority class",
        title=f"Separability of {shown}\n({site}, mean ± std over folds)",
        xlabel=layer_axis_label(site),
    )
    ax = fig.axes[0]
    ax.set_ylim(min(chance, *(np.min(s["mean"]) for s in series.values())) - 0.05, 1.02)
    handles, names = ax.get_legend_handles_labels()
    if (legend := ax.get_legend()) is not None:
        legend.remove()
    with style():
        fig.legend(handles, names, loc="outside lower center", ncols=min(len(names), 3))
    return fig


def _trailing_mean(values: np.ndarray, smooth: int) -> np.ndarray:
    """Trailing moving average of ``smooth`` records (the first ones average what precedes them)."""
    if smooth <= 1 or len(values) < smooth:
        return values
    head = np.cumsum(values[: smooth - 1]) / np.arange(1, smooth)
    return np.concatenate([head, np.convolve(values, np.ones(smooth) / smooth, mode="valid")])


def plot_training_curves(
    runs: Mapping[str, Mapping[str, Sequence[float]]], *, smooth: int = 1, band: str | None = None
) -> Figure:
    """Training loss against cumulative FLOPs and against tokens (paper Figures 1, 10).

    ``runs[label]`` holds ``"flops"``, ``"tokens"`` and ``"loss"`` (n_records,), e.g. the columns of
    a run's metrics.jsonl, or a mean over seeds with ``"low"``/``"high"`` (n_records,) around it, shaded
    and named by ``band`` in the titles (e.g. ``"mean, band: min-max over 3 seeds"``; required when a
    run has a band, so no band goes unlabelled; it is the figure's subtitle). ``smooth`` > 1 applies a trailing moving average of that
    many records (to the band's edges as well).
    """
    if not runs:
        raise ValueError("plot_training_curves needs at least one run")
    if smooth < 1:
        raise ValueError(f"smooth must be >= 1, got {smooth}")
    banded = [label for label, run in runs.items() if "low" in run or "high" in run]
    if banded and band is None:
        raise ValueError(f"{banded[0]} has a band (low/high): say what it is with band=")
    with style():
        fig, axes = _new_figure(2, 1, sharey=True)
        for i, (label, run) in enumerate(runs.items()):
            loss = _trailing_mean(_as_1d(f"{label} loss", run["loss"]), smooth)
            for ax, key in zip(axes[0], ("flops", "tokens"), strict=True):
                x = _as_1d(f"{label} {key}", run[key])
                ax.plot(x, loss, color=color(i), linestyle=LINESTYLES[i % len(LINESTYLES)], label=label)
                if label in banded:
                    low, high = (
                        _trailing_mean(_as_1d(f"{label} {k}", run[k]), smooth) for k in ("low", "high")
                    )
                    ax.fill_between(x, low, high, color=color(i), alpha=0.2, linewidth=0)
        axes[0, 0].set(
            xlabel="training FLOPs",
            ylabel="training loss [nats/token]",
            xscale="log",
            title="Loss vs compute",
        )
        axes[0, 0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: no clutter
        axes[0, 1].set(xlabel="training tokens", title="Loss vs data")
        axes[0, 1].ticklabel_format(axis="x", style="sci", scilimits=(0, 3))
        axes[0, 0].legend()
        if band:
            fig.suptitle(f"Training loss ({band})")
    return fig


def plot_accuracy_by_operators(
    accuracy: Mapping[str, Mapping[int, float]],
    *,
    title: str | None = None,
    intervals: Mapping[str, Mapping[int, tuple[float, float]]] | None = None,
    interval_label: str | None = None,
) -> Figure:
    """Arithmetic-task accuracy per operator count, grouped bars per model (paper Figure 4b).

    ``accuracy[label][n_operators]`` is a fraction in [0, 1]. ``intervals[label][n_operators]`` =
    (low, high) draws an error bar from low to high on that bar, named by ``interval_label`` in the
    title (e.g. ``"error bars: 95 % t-interval of the mean over 5 seeds"``; required with intervals).
    """
    if not accuracy:
        raise ValueError("plot_accuracy_by_operators needs at least one model")
    if intervals is not None and not interval_label:
        raise ValueError("plot_accuracy_by_operators: say what the error bars are with interval_label=")
    counts = sorted({int(n) for acc in accuracy.values() for n in acc})
    width = 0.8 / len(accuracy)
    with style():
        # wide enough for every bar's value label; the legend goes below, never over bars or the title
        fig, axes = _new_figure(size=(max(4.2, 1.6 + 0.5 * len(counts) * len(accuracy)), 3.8))
        ax = axes[0, 0]
        for i, (label, acc) in enumerate(accuracy.items()):
            acc = {int(k): float(v) for k, v in acc.items()}
            xs = np.arange(len(counts)) + (i - (len(accuracy) - 1) / 2) * width
            ys = np.array([acc.get(n, np.nan) for n in counts])
            yerr, tops = None, ys
            if intervals is not None and label in intervals:
                ci = {int(k): v for k, v in intervals[label].items()}
                low, high = (np.array([ci.get(n, (np.nan, np.nan))[j] for n in counts]) for j in (0, 1))
                yerr = np.vstack([ys - low, high - ys])  # (2, tiers): distances below and above the bar
                tops = np.fmax(ys, high)  # each value written above its error bar
            ax.bar(
                xs,
                ys,
                width=width,
                yerr=yerr,
                capsize=3 if yerr is not None else 0,
                error_kw={"elinewidth": 1, "ecolor": "0.2"},
                color=color(i),
                label=label,
                hatch=["", "//", "..", "xx"][i % 4],
                edgecolor="white",
                linewidth=0.5,
            )
            for x, y, top in zip(xs, ys, tops, strict=True):
                if np.isfinite(y):
                    ax.annotate(
                        f"{y:.0%}",
                        (x, top),
                        xytext=(0, 2.5),
                        textcoords="offset points",
                        ha="center",
                        fontsize=7,
                    )
        ax.set_xticks(range(len(counts)), [str(n) for n in counts])
        ax.set(
            xlabel="operators in expression (tier)",
            ylabel="exact-answer accuracy",
            ylim=(0, 1.08),
            title=(title or "Arithmetic expressions: accuracy by operator count")
            + (f"\n({interval_label})" if intervals is not None else ""),
        )
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(axis="x", visible=False)
        fig.legend(loc="outside lower center", ncols=min(len(accuracy), 2))
    return fig


def plot_blimp_layers(
    curves: Mapping[str, Mapping[str, Sequence[float]]], *, model: str, site: str
) -> Figure:
    """BLiMP probe accuracy per layer, one line per paradigm, for one model (the curves that Tables 2/11
    average over tasks per block).

    ``curves[paradigm]`` is a ``plot_layer_curves`` series (``"mean"``, optional ``"std"``).
    The legend (one entry per paradigm, names of up to ~50 characters) sits right of the plot, never
    over the lines or the y label; the figure widens by the legend's width so the plotting area keeps
    its size (a legend inside the axes, larger than them, left constrained layout no room at all).
    """
    fig = plot_layer_curves(
        curves,
        ylabel="probe accuracy (good vs bad)",
        baseline=0.5,
        title=f"{model}: BLiMP probes per layer ({site}, mean-pooled)",
        xlabel=layer_axis_label(site),
    )
    _legend_beside(fig, fontsize=7)
    return fig


# Entries per legend column of a figure whose legend sits beside the plot (fit its default height).
LEGEND_ROWS = 14


def plot_blimp_table2(rows: Sequence[Mapping]) -> Figure:
    """BLiMP probes as one number per model and site (bars; error bars = the rows' spread): each task's mean
    over the probed layers, then the mean over tasks. A summary, not the paper's Table 2 layout, which is per
    block (`lime_probe.probes.blimp.blimp_layer_table`, the analysis's ``blimp_table2_layers`` table).

    ``rows`` are ``blimp.blimp_table`` rows (``model``, ``site``, ``accuracy_mean``, ``accuracy_std``,
    ``n_tasks`` and ``spread``: "folds", the mean over tasks of each task's fold std, or "tasks", the std
    over tasks; rows without it are over tasks); chance (0.5) is drawn as a dashed line and each bar is
    labelled with its value.
    """
    models = list(dict.fromkeys(r["model"] for r in rows))
    sites = list(dict.fromkeys(r["site"] for r in rows))
    by = {(r["model"], r["site"]): r for r in rows}
    fig, axes = _new_figure(size=(max(4.0, 1.6 * len(models) * len(sites)), 3.6))
    ax = axes[0, 0]
    width = 0.8 / len(sites)
    for j, site in enumerate(sites):
        x = np.arange(len(models)) + (j - (len(sites) - 1) / 2) * width
        mean = [by[m, site]["accuracy_mean"] if (m, site) in by else np.nan for m in models]
        std = [by[m, site]["accuracy_std"] if (m, site) in by else np.nan for m in models]
        bars = ax.bar(x, mean, width, yerr=std, capsize=3, color=color(j), label=site)
        ax.bar_label(bars, labels=[f"{v:.3f}" for v in mean], fontsize=7, padding=2)
    ax.axhline(0.5, color="0.4", linestyle="--", linewidth=1, label="chance")
    ax.set_xticks(np.arange(len(models)), models)
    ax.set_ylim(0, 1.05)
    n_tasks = "/".join(map(str, sorted({r["n_tasks"] for r in rows})))
    spreads = {r.get("spread", "tasks") for r in rows}
    if len(spreads) != 1:
        raise ValueError(f"plot_blimp_table2: rows mix spreads {sorted(spreads)}")
    spread = {"folds": "± mean fold std", "tasks": "± std over tasks"}[spreads.pop()]
    ax.set_ylabel(f"probe accuracy (mean {spread})")
    ax.set_title(
        "BLiMP probes, one number per model and site\n"
        f"(each task's mean over the probed layers; mean over {n_tasks} tasks {spread})"
    )
    ax.legend(fontsize=8, loc="lower right")
    return fig


def plot_bars(values: Mapping[str, float], *, ylabel: str, title: str = "") -> Figure:
    """One bar per label (e.g. a model's perplexity), its value written above it."""
    with style():
        fig, axes = _new_figure(size=(max(3.0, 0.9 * len(values) + 1.5), 3.2))
        ax = axes[0, 0]
        bars = ax.bar(list(values), list(values.values()), color=[color(i) for i in range(len(values))])
        ax.bar_label(bars, fmt="%.4g")
        ax.set_ylabel(ylabel)
        if title:
            ax.set_title(title)
    return fig


def plot_intervals(rows: Sequence[Mapping], *, title: str) -> Figure:
    """Forest plots, one panel per ``panel`` (an endpoint, in its own unit): one horizontal interval per
    row (``label``, ``mean``, ``low``, ``high``) and a dashed line at zero.

    Row labels wrap at `LABEL_CHARS` characters and panel titles at the figure's width, so long comparisons
    ("A vs B", "routing at X - routing at Y") leave the intervals most of the width."""
    panels: dict[str, list[Mapping]] = {}
    for r in rows:
        panels.setdefault(r["panel"], []).append(r)
    labels = {p: [textwrap.fill(r["label"], LABEL_CHARS) for r in prs] for p, prs in panels.items()}
    titles = {p: textwrap.fill(p, 2 * LABEL_CHARS) for p in panels}
    heights = [
        0.2 * sum(ln.count("\n") + 2 for ln in labels[p]) + 0.2 * titles[p].count("\n") + 0.7 for p in panels
    ]
    with style():
        fig = Figure(figsize=(7.5, sum(heights) + 0.6), layout="constrained")
        axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
        for ax, (panel, prs) in zip(axes, panels.items(), strict=True):
            for i, r in enumerate(prs):
                err = [[r["mean"] - r["low"]], [r["high"] - r["mean"]]]
                ax.errorbar(r["mean"], i, xerr=err, fmt="o", color=color(0), capsize=3)
            ax.axvline(0.0, color="0.5", linewidth=0.8, linestyle="--")
            ax.set_yticks(range(len(prs)), labels[panel])
            ax.set_ylim(len(prs) - 0.5, -0.5)
            # Few x ticks: small endpoints (accuracy differences of 0.005) have long labels that would touch.
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
            ax.set_title(titles[panel], fontsize="medium", loc="left")
        fig.suptitle(title)
    return fig


# Characters per line of a forest plot's row label (its panel titles take twice as many).
LABEL_CHARS = 34
