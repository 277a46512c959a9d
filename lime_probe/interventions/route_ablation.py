"""Route ablation: does a trained LIMe use its reads of earlier layers, and which ones?

Each cut is a `RouteEdit` that zeroes the weights one layer gives one source layer (every routed head), run
over the same token windows as the unedited model; it is reported as the rise of the mean next-token loss
(nats) and the change of the matrix entropy of that layer's routed values (what its heads attend to; the
official analysis's values, the entropy's ``lime`` preset). Each cut comes plain and renormalised (the
layer's remaining weights rescaled to their L1 mass before the cut: `lime_probe.interventions.edits`). Two
more cuts per layer remove all its cross-layer reads at once (source "cross-layer": self only), and one
removes every layer's (layer and source "all").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from lime_probe.extraction.tracing import as_nnsight
from lime_probe.interventions.edits import RouteEdit, routers_of
from lime_probe.interventions.run import EditedRun, run_with_edits

SITE = "routed_values"
CROSS = "cross-layer"  # the source of a cut of every read but the layer's own
ALL = "all"  # the layer and source of the cut of every layer's cross-layer reads


@dataclass(frozen=True)
class Cut:
    """One route ablation: the `edits` it applies, and how its row names it (layer, source, renormalised)."""

    layer: int | str
    source: int | str
    renormalized: bool
    edits: tuple[RouteEdit, ...]


def cuts(hf: Any, renormalize: Sequence[bool] = (False, True)) -> Iterator[Cut]:
    """Every cut of `hf`'s routes: each (layer, source) pair, then each layer's cross-layer reads, then all
    layers' at once; each with and without renormalising, as `renormalize` asks."""
    routers = routers_of(hf)
    routed = [i for i, r in enumerate(routers) if len(r.sources) > 1]
    for renorm in renormalize:
        for layer in routed:
            for source in routers[layer].sources[:-1]:
                yield Cut(layer, source, renorm, (RouteEdit(layer, [source], renormalize=renorm),))
        for layer in routed:
            yield Cut(layer, CROSS, renorm, (RouteEdit(layer, renormalize=renorm),))
        yield Cut(ALL, ALL, renorm, tuple(RouteEdit(layer, renormalize=renorm) for layer in routed))


def route_ablation(
    model: Any,
    tokenizer: Any,
    windows: Sequence[list[int]],
    renormalize: Sequence[bool] = (False, True),
    batch_size: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Every cut of `cuts` on the token `windows` (lists of ids of one length): one row per cut with
    layer, source, renormalized, loss and base_loss (the cut and the unedited model's mean next-token loss,
    nats per token), delta_loss (their difference), value_entropy, base_value_entropy and
    delta_value_entropy (the routed values of the cut layer; for layer "all" the mean over the cut layers).

    Raises:
        ValueError: a model without routes, in one line.
    """
    from lime_probe.probes.entropy import entropy_config, layer_entropy

    nn_model, tokenizer = as_nnsight(model, tokenizer)
    hf = nn_model._module
    routers_of(hf)  # refuses a model that does not route before any forward pass
    config = entropy_config("lime")

    def measure(edits: Sequence[RouteEdit]) -> tuple[EditedRun, dict[int, float]]:
        run = run_with_edits(nn_model, tokenizer, windows, routes=edits, read=[SITE], batch_size=batch_size)
        assert run.acts is not None
        entropy = {
            layer: layer_entropy(run.acts.sequences(SITE, layer), config, seed=seed).mean
            for layer in run.acts.layers(SITE)
        }
        return run, entropy

    base, base_entropy = measure(())
    rows = []
    all_cuts = list(cuts(hf, renormalize))
    for cut in tqdm(all_cuts, desc="route ablation", unit="cut", disable=not progress):
        run, entropy = measure(cut.edits)
        layers = [edit.layer for edit in cut.edits]
        value = sum(entropy[layer] for layer in layers) / len(layers)
        before = sum(base_entropy[layer] for layer in layers) / len(layers)
        rows.append(
            {
                "layer": cut.layer,
                "source": cut.source,
                "renormalized": cut.renormalized,
                "loss": run.loss(),
                "base_loss": base.loss(),
                "delta_loss": run.loss() - base.loss(),
                "value_entropy": value,
                "base_value_entropy": before,
                "delta_value_entropy": value - before,
            }
        )
    return rows
