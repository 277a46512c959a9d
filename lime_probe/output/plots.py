"""Figures in the style of the LIMe paper, drawn from plain arrays and dicts: the package style (palette,
rcParams, layer axis labels), `save_figure`, and the maps: heatmaps (CKA, patching grids), router and mixing
weights, t-SNE grids. The line and bar charts (per-layer curves, training curves, bars, intervals) are in
`charts`, drawn in this style.

Every ``plot_*`` function (here and in `charts`) takes numbers (no models, no tensors on a device) and
returns a ``matplotlib.figure.Figure`` built without pyplot, so it is thread-safe, leaks no global state,
and displays inline in Jupyter. ``save_figure`` writes it as PNG and PDF atomically.

Colours come from the Okabe-Ito palette (safe for the common colour-vision deficiencies);
models keep the same colour across every figure of a run because colours are assigned by
the order of the labels passed in.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.rcsetup import cycler

from lime_model.files import atomic_path

# Okabe & Ito (2008), "Color Universal Design": distinguishable under protan/deuter/tritan vision.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442"]
# Line styles double the colour cue so curves stay apart in greyscale print.
LINESTYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
# A perceptually uniform sequential map that also reads in greyscale, for heatmaps (drawn with seaborn).
SEQUENTIAL_CMAP = "viridis"

STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 150,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "lines.linewidth": 1.8,
    "lines.markersize": 4,
    "legend.frameon": False,
    "axes.prop_cycle": cycler(color=PALETTE),
    "pdf.fonttype": 42,  # embed TrueType so PDF text stays editable/searchable
    "svg.hashsalt": "lime-probe",  # SVG element ids are otherwise random per run
}


@contextmanager
def style():
    """Context in which new artists take the package style (rcParams are read at creation)."""
    with matplotlib.rc_context(STYLE):
        yield


def color(i: int) -> str:
    """The i-th palette colour (cycled)."""
    return PALETTE[i % len(PALETTE)]


def line_style(i: int) -> dict[str, str]:
    """Colour, dash and marker of the i-th line of a figure (keyword arguments of ``Axes.plot``).

    Colour and dash cycle with the line; the marker moves one step further each time the colours wrap
    round, so no two of the first ``len(PALETTE) * len(MARKERS)`` (64) lines share all three: equal
    colours mean i = j (mod 8), and then equal markers mean i // 8 = j // 8 (mod 8).
    """
    n = len(PALETTE)
    return {
        "color": PALETTE[i % n],
        "linestyle": LINESTYLES[i % len(LINESTYLES)],
        "marker": MARKERS[(i + i // n) % len(MARKERS)],
    }


def _new_figure(ncols: int = 1, nrows: int = 1, *, size: tuple[float, float] | None = None, **kw):
    width, height = size or (4.2 * ncols, 3.2 * nrows)
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


# PDF and SVG otherwise stamp the time of writing, so re-running a study would change every figure's bytes.
_NO_DATE = {"pdf": {"CreationDate": None}, "svg": {"Date": None}}


def save_figure(fig: Figure, stem: str | os.PathLike, formats: Sequence[str] = ("png", "pdf")) -> list[Path]:
    """Write ``fig`` to ``stem.png`` and ``stem.pdf``, each all or nothing (``lime_model.files.atomic_path``),
    with the permissions a plain ``open()`` gives.

    Returns the written paths in the order of ``formats``. No creation date is embedded, so the same figure
    gives the same bytes on every run.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = stem.with_name(f"{stem.name}.{fmt}")
        with atomic_path(path) as tmp, style():
            fig.savefig(
                tmp, format=fmt, dpi=STYLE["savefig.dpi"], bbox_inches="tight", metadata=_NO_DATE.get(fmt)
            )
        paths.append(path)
    return paths


def _as_1d(name: str, values) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    return arr


def layer_axis_label(site: str) -> str:
    """The layer axis of a per-layer figure of `site`, with its indexing convention.

    ``hidden`` has L+1 layers, X_0 (the embeddings) to X_L (block L's output); the per-block sites
    (``values``, ``keys``, routed ones) have L, numbered 0..L-1 by the block they come from.
    """
    if site == "hidden":
        return "layer l (X_0 = embeddings, X_l = output of block l)"
    if site == "final":
        return "layer (output of the final norm)"
    return f"block l (0 = first block; {site} of block l)"


def plot_heatmap(
    matrix,
    *,
    row_labels: Sequence,
    col_labels: Sequence,
    xlabel: str,
    ylabel: str,
    title: str,
    cbar_label: str,
    annotate: bool | None = None,
    fmt: str = ".2f",
    vmin: float | None = None,
    vmax: float | None = None,
    ax=None,
    cmap: str = SEQUENTIAL_CMAP,
) -> Figure:
    """A labelled heatmap of ``matrix`` (n_rows, n_cols); NaN cells are left blank.

    ``annotate`` writes each value in its cell (default: when the matrix has <= 200 cells).
    """
    m = np.asarray(matrix, dtype=float)
    if m.ndim != 2 or m.shape != (len(row_labels), len(col_labels)):
        raise ValueError(
            f"matrix shape {m.shape} does not match {len(row_labels)} row and {len(col_labels)} column labels"
        )
    if annotate is None:
        annotate = m.size <= 200
    with style():
        if ax is None:
            label_width = 0.07 * max(len(str(r)) for r in row_labels)  # inches of the widest row label
            fig, axes = _new_figure(
                size=(max(3.6, 0.45 * m.shape[1] + 2.0 + label_width), max(2.8, 0.35 * m.shape[0] + 1.4))
            )
            ax = axes[0, 0]
        # seaborn masks the NaN cells, centres the ticks and picks a legible annotation colour per cell
        sns.heatmap(
            m,
            ax=ax,
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
            annot=annotate,
            fmt=fmt,
            annot_kws={"fontsize": 7},
            xticklabels=[str(c) for c in col_labels],
            yticklabels=[str(r) for r in row_labels],
            cbar_kws={"label": cbar_label, "shrink": 0.9},
        )
        ax.tick_params(axis="y", labelrotation=0)
        ax.grid(False)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return ax.figure


def plot_router(weights, *, label: str, sources_label: str = "buffered layer (memory source)") -> Figure:
    """Router weights, layer x buffered layer (paper Figure 5).

    ``weights`` (n_layers, n_sources): row i is layer i's normalised |R| averaged over heads;
    cells a layer cannot read (e.g. later layers) are NaN and shown blank.
    """
    m = np.asarray(weights, dtype=float)
    if m.ndim != 2:
        raise ValueError(f"router weights must be 2-D (layer x source), got shape {m.shape}")
    return plot_heatmap(
        m,
        row_labels=range(m.shape[0]),
        col_labels=range(m.shape[1]),
        xlabel=sources_label,
        ylabel="layer (reader)",
        cbar_label="share of |R| (row sums to 1)",
        title=f"{label}: where each layer reads its keys/values",
        vmin=0.0,
    )


# A diverging map for signed changes, centred on zero (blue below, red above; reads in colour-blind vision).
DIVERGING_CMAP = "RdBu_r"


def plot_router_beside_initial(weights, initial, *, label: str, initial_label: str) -> Figure:
    """Router weights after training | at initialisation | the change (trained - initial), layer x
    buffered layer, each ``(n_layers, n_sources)`` as in `plot_router` (NaN cells blank).

    ``initial_label`` says what the initial map is (the run's own step 0, or the init's expected map), on
    a line of its own under the main title (a panel title that long would wrap into it); the change is
    drawn on a diverging scale symmetric about 0."""
    trained, start = np.asarray(weights, dtype=float), np.asarray(initial, dtype=float)
    if trained.ndim != 2 or trained.shape != start.shape:
        raise ValueError(
            f"router weights {trained.shape} and initial weights {start.shape} must be the same 2-D shape"
        )
    change = trained - start
    reach = float(np.nanmax(np.abs(change))) if np.isfinite(change).any() else 1.0
    vmax = float(np.nanmax([np.nanmax(trained), np.nanmax(start)]))
    n, k = trained.shape
    with style():
        fig, axes = _new_figure(3, size=(3 * max(3.6, 0.3 * k + 2.2), max(3.0, 0.3 * n + 1.6)))
        common: dict[str, Any] = {
            "row_labels": range(n),
            "col_labels": range(k),
            "xlabel": "buffered layer",
            "annotate": False,
        }
        panels: tuple[tuple[Any, np.ndarray, str, dict[str, Any]], ...] = (
            (
                axes[0, 0],
                trained,
                "trained",
                {"vmin": 0.0, "vmax": vmax, "cbar_label": "share of |R| (row sums to 1)"},
            ),
            (
                axes[0, 1],
                start,
                "initial",
                {"vmin": 0.0, "vmax": vmax, "cbar_label": "share of |R| (row sums to 1)"},
            ),
            (
                axes[0, 2],
                change,
                "trained - initial",
                {"vmin": -reach, "vmax": reach, "cmap": DIVERGING_CMAP, "cbar_label": "change in share"},
            ),
        )
        for ax, m, title, extra in panels:
            plot_heatmap(m, **common, ylabel="layer (reader)", title=title, ax=ax, **extra)
        fig.suptitle(
            f"{label}: where each layer reads its keys/values, trained beside initial\n({initial_label})"
        )
    return fig


def plot_mixing_weights(weights, *, label: str, title: str) -> Figure:
    """One matrix of a cross-layer baseline's learned mixing weights (its model's ``mixing_weights()``).

    ``weights`` (n_rows, n_cols): rows are destination layers (or streams), columns sources, as that
    method's docstring states; raw values (they may be negative or exceed 1), NaN cells blank.
    """
    m = np.asarray(weights, dtype=float)
    if m.ndim != 2:
        raise ValueError(f"mixing weights must be 2-D (destination x source), got shape {m.shape}")
    return plot_heatmap(
        m,
        row_labels=range(m.shape[0]),
        col_labels=range(m.shape[1]),
        xlabel="source",
        ylabel="destination (layer)",
        cbar_label="weight",
        title=f"{label}: {title}",
    )


def plot_router_heads(per_head, *, label: str, layers: Sequence[int] | None = None) -> Figure:
    """Per-head router weights (paper Figure 9).

    ``per_head`` (n_layers, n_heads, n_sources): one panel per layer, rows are the layer's KV
    heads, columns the sources it mixes; NaN cells are blank. ``layers`` names the panels
    (default 0..n_layers-1).
    """
    t = np.asarray(per_head, dtype=float)
    if t.ndim != 3:
        raise ValueError(f"per-head router weights must be 3-D (layer x head x source), got shape {t.shape}")
    layers = list(range(t.shape[0])) if layers is None else list(layers)
    if len(layers) != t.shape[0]:
        raise ValueError(f"{len(layers)} layer names for {t.shape[0]} layers")
    ncols = min(4, len(layers))
    nrows = -(-len(layers) // ncols)
    vmax = float(np.nanmax(t)) if np.isfinite(t).any() else 1.0
    with style():
        fig, axes = _new_figure(ncols, nrows, size=(3.0 * ncols + 0.8, 2.2 * nrows + 0.6))
        for k, ax in enumerate(axes.flat):
            if k >= len(layers):
                ax.set_visible(False)
                continue
            sns.heatmap(
                t[k],
                ax=ax,
                cmap=SEQUENTIAL_CMAP,
                vmin=0.0,
                vmax=vmax,
                cbar=False,
                xticklabels=range(t.shape[2]),
                yticklabels=range(t.shape[1]),
            )
            ax.tick_params(axis="y", labelrotation=0)
            ax.grid(False)
            ax.set(title=f"layer {layers[k]}", xlabel="buffered layer", ylabel="KV head")
        # one colour bar for every panel: they share vmin/vmax
        fig.colorbar(
            axes.flat[0].collections[0],
            ax=axes.ravel().tolist(),
            label="share of |R| (row sums to 1)",
            shrink=0.9,
        )
        fig.suptitle(f"{label}: router weights per head")
    return fig


def plot_tsne_grid(
    embeddings: Mapping[str, Mapping[int, np.ndarray]],
    labels: Mapping[str, Sequence[str]] | Sequence[str],
    *,
    site: str,
) -> Figure:
    """t-SNE scatter grid: one row per model, one column per layer (paper Figures 3, 8).

    ``embeddings[model][layer]`` is (n_points, 2); ``labels`` gives each point's word, either one
    sequence shared by all models or a mapping model -> sequence. Each word keeps one colour.
    A map with fewer than ``FEW_TSNE_POINTS`` points gets a note saying so and why it says little.
    """
    if not embeddings:
        raise ValueError("plot_tsne_grid needs at least one model")
    models = list(embeddings)
    layers = list(next(iter(embeddings.values())))
    per_model = labels if isinstance(labels, Mapping) else dict.fromkeys(models, labels)
    words = sorted({str(w) for m in models for w in per_model[m]}, key=_natural)
    with style():
        fig, axes = _new_figure(
            len(layers), len(models), size=(2.3 * len(layers) + 1.6, 2.3 * len(models) + 0.5)
        )
        for r, model in enumerate(models):
            lab = np.asarray([str(w) for w in per_model[model]])
            for c, layer in enumerate(layers):
                ax = axes[r, c]
                xy = np.asarray(embeddings[model][layer])
                if xy.shape != (len(lab), 2):
                    raise ValueError(
                        f"{model} layer {layer}: embedding shape {xy.shape}, expected ({len(lab)}, 2)"
                    )
                for k, word in enumerate(words):
                    sel = lab == word
                    look = line_style(k)  # colour and marker: no two of the first 64 words share both
                    ax.scatter(
                        xy[sel, 0],
                        xy[sel, 1],
                        s=10,
                        color=look["color"],
                        marker=look["marker"],
                        alpha=0.75,
                        linewidths=0,
                        label=word,
                    )
                ax.set_xticks([])
                ax.set_yticks([])
                ax.grid(False)
                if r == 0:
                    ax.set_title(f"{layer_axis_label(site).split()[0]} {layer}")  # "layer 3" or "block 3"
                if c == 0:
                    ax.set_ylabel(model)
        handles, names = axes[0, 0].get_legend_handles_labels()
        fig.legend(handles, names, loc="outside right center", markerscale=2.5, title="token")
        fig.suptitle(f"t-SNE of {site} representations, models × layers")
        notes = [f"columns: {layer_axis_label(site)}"]
        fewest = min(len(per_model[m]) for m in models)
        if fewest < FEW_TSNE_POINTS:
            notes.append(
                f"only {fewest} points in a map: the texts hold few occurrences of these tokens "
                "(more text gives more); with so few points the layout is mostly chance"
            )
        fig.supxlabel("\n".join(textwrap.fill(n, 90) for n in notes), fontsize=8, color="0.3")
    return fig


# Below this many points a t-SNE map is mostly chance (perplexity has to shrink to fit, clusters are noise).
FEW_TSNE_POINTS = 40


def _natural(word: str) -> tuple:
    """Sort key putting numbers in numeric order before other tokens: 2 < 10 < 'are' < 'is'."""
    w = word.strip()
    return (0, int(w), word) if w.isdigit() else (1, 0, word)


def plot_heatmaps(panels: Sequence[Mapping], *, title: str) -> Figure:
    """Heatmaps side by side, one per panel: each a mapping of `plot_heatmap`'s keywords (``matrix``,
    ``row_labels``, ``col_labels``, ``xlabel``, ``ylabel``, ``title``, ``cbar_label``, optional ``cmap``,
    ``vmin``, ``vmax``), under one `title`."""
    rows = max(len(p["row_labels"]) for p in panels)
    cols = max(len(p["col_labels"]) for p in panels)
    cell = 0.45 if rows * cols <= 200 else 0.22  # inches: room for the numbers where they are written in
    fig, axes = _new_figure(
        len(panels), size=(len(panels) * max(3.8, cell * cols + 2.2), max(3.0, 0.8 * cell * rows + 1.6))
    )
    for ax, panel in zip(axes[0], panels, strict=True):
        plot_heatmap(ax=ax, **panel)
    with style():
        fig.suptitle(title)
    return fig
