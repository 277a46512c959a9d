"""Figures draw exactly the numbers they are given, in the package style, and save atomically."""

import itertools
import warnings

import numpy as np
import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PathCollection, PolyCollection, QuadMesh

from lime_probe.output import charts as C
from lime_probe.output import plots as F
from lime_probe.protocol import TABLE2_TASKS

rng = np.random.default_rng(0)


def _series(n_layers=4, models=("LIMe", "LLaMA")):
    out = {}
    for m in models:
        mean = rng.random(n_layers)
        out[m] = {"mean": mean, "low": mean - 0.1, "high": mean + 0.2}
    return out


def test_layer_curves_plot_the_means_and_bands():
    series = _series()
    fig = C.plot_entropy(series, site="values", alpha=0.5)
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if ln.get_label() in series]
    assert [ln.get_label() for ln in lines] == list(series)
    for ln, s in zip(lines, series.values(), strict=True):
        np.testing.assert_allclose(ln.get_xdata(), np.arange(4))
        np.testing.assert_allclose(ln.get_ydata(), s["mean"])
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2
    for band, s in zip(bands, series.values(), strict=True):
        ys = band.get_paths()[0].vertices[:, 1]
        assert ys.min() == pytest.approx(s["low"].min()) and ys.max() == pytest.approx(s["high"].max())
    assert "α=0.5" in ax.get_ylabel() and "values" in ax.get_title()
    # distinct colours for distinct models
    assert lines[0].get_color() != lines[1].get_color()


def test_separability_draws_std_band_and_chance_line():
    series = {"m": {"mean": [0.6, 0.8, 0.9], "std": [0.05, 0.02, 0.01], "layers": [0, 1, 2]}}
    fig = C.plot_separability(series, site="hidden", words=[" is", " are"], chance=0.5)
    ax = fig.axes[0]
    chance = [ln for ln in ax.get_lines() if ln.get_label() == "majority class"]
    assert len(chance) == 1 and set(chance[0].get_ydata()) == {0.5}
    ys = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.55) and ys.max() == pytest.approx(0.91)
    assert "' is'" in ax.get_title()


def _mesh(ax) -> QuadMesh:
    """A heatmap's cells (seaborn draws one QuadMesh)."""
    (mesh,) = [c for c in ax.collections if isinstance(c, QuadMesh)]
    return mesh


def _cells(ax) -> np.ma.MaskedArray:
    return _mesh(ax).get_array()


def test_heatmap_shows_the_matrix_with_nan_blank():
    m = np.array([[1.0, np.nan], [0.3, 0.7]])
    fig = F.plot_router(m, label="LIMe")
    cells = _cells(fig.axes[0]).reshape(m.shape)
    assert cells.mask[0, 1] and not cells.mask[1, 1]
    np.testing.assert_allclose(cells.data[~cells.mask], m[np.isfinite(m)])
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    assert texts == ["0.30", "0.70", "1.00"]
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # row 0 on top, as in the paper
    assert fig.axes[1].get_ylabel() == "share of |R| (row sums to 1)"  # the colour bar
    assert _mesh(ax).get_cmap().name == F.SEQUENTIAL_CMAP


def test_router_heads_one_panel_per_layer():
    t = rng.random((3, 2, 4))
    fig = F.plot_router_heads(t, label="LIMe")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["layer 0", "layer 1", "layer 2"]
    for k, ax in enumerate(panels):
        np.testing.assert_allclose(_cells(ax).reshape(t[k].shape), t[k])
        assert _mesh(ax).get_clim() == (0.0, t.max())  # one shared colour scale


def test_tsne_grid_places_every_point_with_its_word():
    words = ["1", "2", "3"] * 5
    emb = {m: {layer: rng.normal(size=(15, 2)) for layer in (0, 2)} for m in ("a", "b")}
    fig = F.plot_tsne_grid(emb, words, site="hidden")
    grid = [ax for ax in fig.axes if ax.collections]
    assert len(grid) == 4
    ax = grid[3]  # model b, layer 2
    for coll in ax.collections:
        assert isinstance(coll, PathCollection)
        sel = np.asarray(words) == coll.get_label()
        np.testing.assert_allclose(coll.get_offsets(), emb["b"][2][sel])


def test_tsne_grid_rejects_misshaped_embeddings():
    with pytest.raises(ValueError, match="expected \\(3, 2\\)"):
        F.plot_tsne_grid({"a": {0: np.zeros((4, 2))}}, ["x", "y", "z"], site="hidden")


def test_training_curves_smoothing_matches_pandas_rolling_mean():
    loss = rng.random(30) + 2
    runs = {"r": {"flops": np.arange(1, 31) * 1e6, "tokens": np.arange(1, 31) * 100, "loss": loss}}
    fig = C.plot_training_curves(runs, smooth=4)
    expected = pd.Series(loss).rolling(4, min_periods=1).mean().to_numpy()
    for ax, key in zip(fig.axes, ("flops", "tokens"), strict=True):
        (line,) = ax.get_lines()
        np.testing.assert_allclose(line.get_xdata(), runs["r"][key])
        np.testing.assert_allclose(line.get_ydata(), expected)
    assert fig.axes[0].get_xscale() == "log"


def test_accuracy_bars_have_the_given_heights():
    acc = {"LIMe": {4: 0.9, 5: 0.5, 6: 0.25}, "LLaMA": {4: 0.8, 6: 0.1}}
    fig = C.plot_accuracy_by_operators(acc)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    np.testing.assert_allclose(heights, [0.9, 0.5, 0.25, 0.8, np.nan, 0.1])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "5", "6"]


def _band_edges(ax):
    """(x, lower edge, upper edge) of the one fill_between band on ``ax``, read from its polygon."""
    (poly,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    v = poly.get_paths()[0].vertices
    # fill_between's path: a start vertex, x forward along the lower edge, back along the upper, closing
    n = (len(v) - 3) // 2
    lower, upper = v[1 : n + 1], v[n + 2 : 2 * n + 2][::-1]
    return lower[:, 0], lower[:, 1], upper[:, 1]


def test_training_curves_shade_the_given_band_and_name_it():
    loss = rng.random(20) + 2
    low, high = loss - rng.random(20), loss + rng.random(20)
    run = {
        "flops": np.arange(1, 21) * 1e6,
        "tokens": np.arange(1, 21) * 100,
        "loss": loss,
        "low": low,
        "high": high,
    }
    fig = C.plot_training_curves({"LIMe": run}, band="mean over 3 seeds, band: min-max over 3 seeds")
    for ax, key in zip(fig.axes, ("flops", "tokens"), strict=True):
        x, lo, hi = _band_edges(ax)
        np.testing.assert_allclose(x, run[key])
        np.testing.assert_allclose(lo, low)
        np.testing.assert_allclose(hi, high)
    assert fig.get_suptitle() == "Training loss (mean over 3 seeds, band: min-max over 3 seeds)"


def test_training_curves_refuse_an_unnamed_band():
    run = {"flops": [1, 2], "tokens": [1, 2], "loss": [2, 1], "low": [1, 0], "high": [3, 2]}
    with pytest.raises(ValueError, match="say what it is"):
        C.plot_training_curves({"LIMe": run})


def test_accuracy_error_bars_span_the_given_intervals():
    acc = {"LIMe": {1: 0.9, 2: 0.5}, "LLaMA": {1: 0.8, 2: 0.2}}
    ci = {"LIMe": {1: (0.85, 0.97), 2: (0.3, 0.6)}, "LLaMA": {1: (0.7, 0.81), 2: (0.0, 0.45)}}
    fig = C.plot_accuracy_by_operators(
        acc, intervals=ci, interval_label="error bars: 95 % t-interval over 5 seeds"
    )
    ax = fig.axes[0]
    assert ax.get_title().endswith("\n(error bars: 95 % t-interval over 5 seeds)")
    spans = sorted(
        (round(float(seg[0, 1]), 9), round(float(seg[1, 1]), 9))
        for c in ax.collections
        for seg in c.get_segments()
    )
    assert spans == sorted(v for per in ci.values() for v in per.values())
    with pytest.raises(ValueError, match="interval_label"):
        C.plot_accuracy_by_operators(acc, intervals=ci)


def test_router_beside_initial_draws_trained_initial_and_their_difference():
    trained, initial = rng.random((4, 4)), rng.random((4, 4))
    trained[np.triu_indices(4, 1)] = initial[np.triu_indices(4, 1)] = np.nan
    fig = F.plot_router_beside_initial(
        trained, initial, label="LIMe", initial_label="initial: step 0, rebuilt from the run's seed 0"
    )
    drawn = [
        ax.collections[0].get_array().reshape(4, 4) for ax in fig.axes if ax.collections and ax.get_title()
    ]
    # short panel titles, one line each; what the initial map is goes on a line of its own under the main title
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == [
        "trained",
        "initial",
        "trained - initial",
    ]
    assert fig.get_suptitle().splitlines() == [
        "LIMe: where each layer reads its keys/values, trained beside initial",
        "(initial: step 0, rebuilt from the run's seed 0)",
    ]
    low = np.tril_indices(4)
    for got, want in zip(drawn, (trained, initial, trained - initial), strict=True):
        np.testing.assert_allclose(np.asarray(got)[low], want[low])
    with pytest.raises(ValueError, match="same 2-D shape"):
        F.plot_router_beside_initial(trained, initial[:3], label="LIMe", initial_label="x")


def test_save_writes_png_and_pdf_and_no_temp_files(tmp_path):
    fig = C.plot_entropy(_series(), site="hidden")
    paths = F.save_figure(fig, tmp_path / "sub" / "entropy")
    assert [p.name for p in paths] == ["entropy.png", "entropy.pdf"]
    assert paths[0].read_bytes().startswith(b"\x89PNG")
    assert paths[1].read_bytes().startswith(b"%PDF")
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["entropy.pdf", "entropy.png"]
    from lime_model.files import umask

    assert [p.stat().st_mode & 0o777 for p in paths] == [0o666 & ~umask()] * 2  # not mkstemp's private 0o600


@pytest.mark.parametrize("fmt", ["pdf", "svg"])
def test_saved_figures_carry_no_time_of_writing_so_reruns_give_the_same_bytes(tmp_path, monkeypatch, fmt):
    # matplotlib reads the time of writing from SOURCE_DATE_EPOCH when set: two different "clocks".
    fig = C.plot_entropy(_series(), site="hidden")
    written = []
    for epoch in ("0", "1000000000"):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
        written.append(F.save_figure(fig, tmp_path / epoch / "entropy", formats=(fmt,))[0].read_bytes())
    assert written[0] == written[1]
    assert b"CreationDate" not in written[0] and b"<dc:date>" not in written[0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: C.plot_layer_curves({}, ylabel="y", title="t"), "at least one series"),
        (lambda: F.plot_router(np.zeros(3), label="x"), "must be 2-D"),
        (lambda: F.plot_router_heads(np.zeros((2, 2)), label="x"), "must be 3-D"),
        (
            lambda: C.plot_training_curves({"r": {"loss": [1], "flops": [1], "tokens": [1]}}, smooth=0),
            "smooth",
        ),
        (
            lambda: F.plot_heatmap(
                np.zeros((2, 2)),
                row_labels=[0],
                col_labels=[0, 1],
                xlabel="",
                ylabel="",
                title="",
                cbar_label="",
            ),
            "does not match",
        ),
    ],
)
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layer_axes_name_their_indexing_convention():
    hidden = C.plot_separability(_series(5), site="hidden", words=[" is", " are"], chance=0.5)
    assert "X_0 = embeddings" in hidden.axes[0].get_xlabel()
    values = C.plot_entropy(_series(4), site="values")
    assert values.axes[0].get_xlabel() == "block l (0 = first block; values of block l)"
    blimp = C.plot_blimp_layers({"p": {"mean": [0.5, 0.6, 0.7]}}, model="m", site="hidden")
    assert "X_0 = embeddings" in blimp.axes[0].get_xlabel()


def test_entropy_far_above_zero_notes_where_the_axis_starts_and_the_gap_without_an_unpaired_interval():
    lime = np.array([5.00, 5.10, 5.20, 5.30])
    llama = np.array([5.00, 5.05, 5.08, 5.11])
    series = {
        "LIMe": {"mean": lime, "low": lime - 0.02, "high": lime + 0.02},
        "LLaMA": {"mean": llama, "low": llama - 0.03, "high": llama + 0.05},
    }
    fig = C.plot_entropy(series, site="values", band="95 % bootstrap CI of the mean over sequences")
    title = fig.axes[0].get_title()
    assert title.startswith("Entropy of values per layer\nband: ")  # the band on lines of its own
    assert (
        " ".join(title.split())
        == "Entropy of values per layer band: 95 % bootstrap CI of the mean over sequences"
    )
    FigureCanvasAgg(fig).draw()  # laid out as saving lays it out
    axes_box = fig.axes[0].get_window_extent()
    title_box = fig.axes[0].title.get_window_extent()
    assert axes_box.x0 <= title_box.x0 and title_box.x1 <= axes_box.x1  # within the plot's width
    assert fig.axes[0].get_legend() is None and len(fig.legends) == 1
    assert fig.legends[0].get_window_extent().x0 >= axes_box.x1  # beside the plot, over no curve
    bottom = fig.axes[0].get_ylim()[0]
    assert bottom > 4  # the automatic axis zooms in ...
    note = " ".join(fig._supxlabel.get_text().split())  # ... so the figure says so (wrapped)
    # the largest gap by hand: layer 3, 5.30 - 5.11 = 0.19; one run per model: the bands over sequences
    # are no interval for the difference, so none is given
    assert note == (
        f"y-axis starts at {bottom:.3g}, not 0; largest gap at layer 3: LIMe − LLaMA = +0.19 nats "
        "(+3.7% of LLaMA); no interval (not paired over two or more seeds)"
    )
    near_zero = C.plot_entropy(
        {"A": {"mean": [0.5, 2.0, 4.0]}, "B": {"mean": [0.4, 1.0, 3.0]}}, site="hidden"
    )
    assert near_zero._supxlabel is None  # an axis that starts near zero needs no note
    assert near_zero.axes[0].get_title() == "Entropy of hidden per layer"  # no band, none named


def test_entropy_gap_over_paired_seeds_has_the_paired_t_interval():
    from scipy.stats import t

    # three seeds x four layers; layer 3 has the largest mean gap
    lime = np.array([[5.0, 5.1, 5.2, 5.30], [5.0, 5.1, 5.2, 5.36], [5.0, 5.1, 5.2, 5.27]])
    llama = np.array([[5.0, 5.05, 5.08, 5.10], [5.0, 5.05, 5.08, 5.12], [5.0, 5.05, 5.08, 5.11]])
    series = {name: {"mean": v.mean(0), "seeds": v} for name, v in (("LIMe", lime), ("LLaMA", llama))}
    note = " ".join(C.gap_note(series, 4.9).split())
    d = [0.30 - 0.10, 0.36 - 0.12, 0.27 - 0.11]  # per seed at layer 3, by hand
    mean = sum(d) / 3
    sd = (sum((x - mean) ** 2 for x in d) / 2) ** 0.5
    half = t.ppf(0.975, 2) * sd / 3**0.5
    assert note.endswith(
        f"LIMe − LLaMA = {mean:+.3g} nats ({mean / llama[:, 3].mean():+.1%} of LLaMA), "
        f"95 % paired t-interval over 3 seeds [{mean - half:+.3g}, {mean + half:+.3g}]"
    )
    # the seeds must pair up: three against two is no paired interval
    series["LLaMA"]["seeds"] = llama[:2]
    assert C.gap_note(series, 4.9).endswith("; no interval (not paired over two or more seeds)")


def test_separability_legend_sits_below_the_axes_not_over_the_lines():
    series = {m: {"mean": np.ones(5), "std": np.zeros(5)} for m in ("LIMe", "LLaMA")}
    fig = C.plot_separability(series, site="hidden", words=[" is", " are"], chance=0.5)
    ax = fig.axes[0]
    assert ax.get_legend() is None and len(fig.legends) == 1
    fig.canvas.draw()
    legend_box = fig.legends[0].get_window_extent()
    axes_box = ax.get_window_extent()
    assert legend_box.y1 <= axes_box.y0  # wholly under the plotting area, so no line at 1.0 is covered
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["LIMe", "LLaMA", "majority class"]


def test_tsne_with_few_points_says_why():
    words = [" 1", " 2", " 3", " 4"]
    few = F.plot_tsne_grid({"m": {0: rng.random((4, 2))}}, words, site="hidden")
    assert "only 4 points in a map" in " ".join(few._supxlabel.get_text().split())
    many = F.plot_tsne_grid({"m": {0: rng.random((80, 2))}}, words * 20, site="values")
    assert many._supxlabel.get_text() == "columns: block l (0 = first block; values of block l)"
    assert many.axes[0].get_title() == "block 0"


# The paper's Table 2 paradigms (Appendix D): long names, ten lines in one figure.
TEN_PARADIGMS = list(TABLE2_TASKS)


def _drawn(fig, tmp_path):
    """Lay `fig` out and render it as saving does, turning every warning (e.g. matplotlib's
    "constrained_layout not applied") into an error."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FigureCanvasAgg(fig)
        fig.canvas.draw()
        F.save_figure(fig, tmp_path / "fig")
    return fig


@pytest.mark.parametrize("n", [10, 20])
def test_blimp_layers_legend_beside_the_plot_distinct_styles_and_no_layout_warning(tmp_path, n):
    names = TEN_PARADIGMS + [f"{p}_again" for p in TEN_PARADIGMS]
    curves = {p: {"mean": rng.random(17), "std": rng.random(17) * 0.05} for p in names[:n]}
    fig = _drawn(C.plot_blimp_layers(curves, model="LIMe", site="hidden"), tmp_path)
    (ax,) = fig.axes
    assert ax.get_legend() is None and len(fig.legends) == 1
    legend_box = fig.legends[0].get_window_extent()
    axes_box = ax.get_window_extent()
    assert legend_box.x0 >= axes_box.x1  # wholly right of the plotting area: no line, no y label covered
    assert axes_box.width > 0.5 * legend_box.width  # and the plot kept a readable size
    lines = [ln for ln in ax.get_lines() if ln.get_label() in curves]
    assert [ln.get_label() for ln in lines] == list(curves)
    looks = {(ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in lines}
    assert len(looks) == n  # no two paradigms drawn alike


def test_line_styles_differ_for_the_first_64_lines():
    looks = [F.line_style(i) for i in range(64)]
    assert len({(s["color"], s["linestyle"], s["marker"]) for s in looks}) == 64
    assert F.line_style(0) != F.line_style(8)  # where colour and marker used to repeat together


@pytest.mark.parametrize(
    "make",
    [
        lambda: C.plot_entropy({m: {"mean": rng.random(17)} for m in "ABCDE"}, site="hidden"),
        lambda: C.plot_separability(
            {m: {"mean": rng.random(17), "std": rng.random(17) * 0.1} for m in "ABCDE"},
            site="values",
            words=[" 1", " 2", " 3", " 4"],
            chance=0.25,
        ),
        lambda: F.plot_heatmap(
            rng.random((10, 5)),
            row_labels=TEN_PARADIGMS,
            col_labels=list("ABCDE"),
            xlabel="model",
            ylabel="paradigm",
            title="BLiMP task accuracy, mean over the probed layers (hidden)",
            cbar_label="probe accuracy",
        ),
        lambda: F.plot_router(rng.random((16, 16)), label="LIMe"),
        lambda: F.plot_router_heads(rng.random((16, 4, 16)), label="LIMe"),
        lambda: F.plot_router_beside_initial(
            rng.random((16, 16)),
            rng.random((16, 16)),
            label="LIMe s0 (full)",
            initial_label="initial: expected step 0 of the init (mean |R| over 64 draws)",
        ),
        lambda: F.plot_tsne_grid(
            {m: {la: rng.random((12, 2)) for la in range(17)} for m in "AB"},
            list("123412341234"),
            site="values",
        ),
        lambda: C.plot_training_curves(
            {
                m: {"flops": np.arange(1, 50) * 1e9, "tokens": np.arange(1, 50) * 1e3, "loss": rng.random(49)}
                for m in "ABCDE"
            }
        ),
        lambda: C.plot_accuracy_by_operators({m: {4: 0.5, 5: 0.4, 6: 0.3} for m in "ABCDE"}),
        lambda: C.plot_training_curves(
            {
                m: {"flops": np.arange(1, 50) * 1e9, "tokens": np.arange(1, 50) * 1e3, "loss": np.ones(49)}
                | {"low": np.zeros(49), "high": np.full(49, 2.0)}
                for m in "ABC"
            },
            band="mean over 3 seeds, band: min-max over 3 seeds",
        ),
        lambda: C.plot_accuracy_by_operators(
            {m: {1: 0.5, 2: 0.4, 3: 0.3} for m in "ABCD"},
            title="Arithmetic expressions: accuracy by operator count, mean over 10 seeds",
            intervals={m: {1: (0.4, 0.6), 2: (0.3, 0.5), 3: (0.1, 0.5)} for m in "ABCD"},
            interval_label="error bars: 95 % t-interval of the mean over 10 seeds",
        ),
        lambda: C.plot_blimp_table2(
            [
                {"model": m, "site": s, "accuracy_mean": 0.7, "accuracy_std": 0.1, "n_tasks": 10}
                for m in "ABCDE"
                for s in ("hidden", "values", "keys")
            ]
        ),
    ],
)
@pytest.mark.slow
def test_every_figure_lays_out_without_warnings(tmp_path, make):
    _drawn(make(), tmp_path)


def test_blimp_one_number_chart_says_what_it_is_not_the_per_block_table_2_layout():
    rows = [
        {"model": m, "site": "values", "accuracy_mean": 0.7, "accuracy_std": 0.1, "n_tasks": 10}
        for m in ("LIMe", "LLaMA")
    ]
    title = C.plot_blimp_table2(rows).axes[0].get_title()
    assert "Table 2" not in title  # the paper's Table 2 is per block: the blimp_table2_layers table
    assert title == (  # rows without a spread are over tasks
        "BLiMP probes, one number per model and site\n"
        "(each task's mean over the probed layers; mean over 10 tasks ± std over tasks)"
    )
    ax = C.plot_blimp_table2([{**r, "spread": "folds"} for r in rows]).axes[0]
    assert ax.get_title().endswith("mean over 10 tasks ± mean fold std)")
    assert ax.get_ylabel() == "probe accuracy (mean ± mean fold std)"
    with pytest.raises(ValueError, match="mix spreads"):
        C.plot_blimp_table2([{**rows[0], "spread": "folds"}, {**rows[1], "spread": "tasks"}])


def test_interval_panels_wrap_long_labels_and_titles_so_the_intervals_keep_the_width():
    """The committed studies' longest labels: every line of a row label and a panel title stays short, and
    the intervals take over half of the figure's width (not a narrow column beside the labels)."""
    long = "value entropy (routed_values; mean over layers) vs value entropy (router_mixed_values; mean over layers)"
    label = "routing at PyTorch's init - routing at LLaMA's init (secondary)"
    rows = [{"panel": long, "label": label, "mean": 1.0, "low": 0.5, "high": 1.5}]
    fig = C.plot_intervals(rows + [{**rows[0], "label": "LIMe - LLaMA"}], title="t")
    (ax,) = fig.axes
    (tick, short) = [t.get_text() for t in ax.get_yticklabels()]
    assert " ".join(tick.split()) == label and max(map(len, tick.splitlines())) <= C.LABEL_CHARS
    assert short == "LIMe - LLaMA"
    title = ax.get_title(loc="left")
    assert " ".join(title.split()) == long and max(map(len, title.splitlines())) <= 2 * C.LABEL_CHARS
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    figure_box = fig.get_window_extent()
    assert ax.get_window_extent().width > 0.5 * figure_box.width
    assert ax.title.get_window_extent().x1 <= figure_box.x1  # the title ends inside the figure


def test_interval_panels_draw_each_rows_mean_and_interval_with_tick_labels_apart():
    rows = [
        {
            "panel": "BLiMP (fraction)",
            "label": "LIMe - LLaMA",
            "mean": -0.00117,
            "low": -0.008283,
            "high": 0.005943,
        },
        {
            "panel": "BLiMP (fraction)",
            "label": "LIMe-LLaMA-kv-init - LLaMA (secondary)",
            "mean": -0.002985,
            "low": -0.01193,
            "high": 0.005962,
        },
        {"panel": "perplexity", "label": "LIMe - LLaMA", "mean": 10.15, "low": 4.755, "high": 15.55},
    ]
    fig = C.plot_intervals(rows, title="t")
    axes = fig.axes
    assert [ax.get_title(loc="left") for ax in axes] == ["BLiMP (fraction)", "perplexity"]
    drawn = []
    for ax in axes:
        for line in ax.get_lines():
            if line.get_marker() == "o":
                drawn.append(float(line.get_xdata()[0]))
    assert drawn == pytest.approx([r["mean"] for r in rows])
    # each interval's whisker ends, from the error-bar segments
    ends = [seg[:, 0] for ax in axes for c in ax.collections for seg in c.get_segments()]
    np.testing.assert_allclose([sorted(e) for e in ends], [[r["low"], r["high"]] for r in rows])
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in axes:
        boxes = [
            t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()
        ]
        # apart by at least a line's height, not merely not overlapping ("-0.0125-0.0100" reads as one)
        assert all(b.x0 - a.x1 >= a.height for a, b in itertools.pairwise(boxes)), ax.get_title(loc="left")
