"""The "layer-by-layer" entropy preset against a few-line numpy rewrite of Skean et al.'s prompt entropy
(OFSkean/information_flow: normalize(), compute_entropy(), repitl's matrixAlphaEntropy)."""

import math

import numpy as np
import pytest
import torch

from lime_probe.probes.entropy import EntropyAccumulator, entropy_config, layer_entropy


def skean_prompt_entropy(Z: np.ndarray, alpha: float = 1.0, max_normalize: bool = False) -> float:
    N, D = Z.shape
    R = Z - Z.mean(0)  # centre the prompt's tokens
    R = R / np.linalg.norm(R, axis=1, keepdims=True)  # L2-normalise rows
    K = R.T @ R if N > D else R @ R.T  # their code takes the D x D matrix when N > D
    K = np.maximum(K, 0.0)  # negative entries set to 0, elementwise
    K = K / np.trace(K)
    ev = np.linalg.eigvalsh(K)
    p = ev[ev > 0] / ev[ev > 0].sum()
    H = float(-(p * np.log(p)).sum()) if alpha == 1 else float(np.log((p**alpha).sum()) / (1 - alpha))
    return H / min(math.log(N), math.log(D)) if max_normalize else H


def prompts(lengths, d, seed):
    g = np.random.default_rng(seed)
    mix = g.normal(size=(d, d)) * np.linspace(2.0, 0.1, d)  # anisotropic, with a mean: like activations
    return [g.normal(size=(t, d)) @ mix + 3.0 for t in lengths]


@pytest.mark.parametrize("lengths,d", [([30, 30, 41], 8), ([5, 9, 12], 16), ([16, 16], 16)])
@pytest.mark.parametrize("alpha", [1.0, 2.0])
@pytest.mark.parametrize("max_normalize", [False, True])
def test_layer_by_layer_matches_skean(lengths, d, alpha, max_normalize):
    seqs = prompts(lengths, d, seed=len(lengths) + d)
    config = entropy_config("layer-by-layer", alpha=alpha, max_normalize=max_normalize)
    acc = EntropyAccumulator(config)
    for z in seqs:  # streamed one prompt at a time
        acc.update([torch.from_numpy(z)])
    want = [skean_prompt_entropy(z, alpha, max_normalize) for z in seqs]
    np.testing.assert_allclose(acc.result().values, want, rtol=0, atol=1e-10)


def test_clamp_changes_the_result():
    """Without the elementwise clamp (plain centre + L2) the entropies differ: the clamp is not a no-op."""
    seqs = [torch.from_numpy(z) for z in prompts([20, 20], 8, seed=1)]
    clamped = layer_entropy(seqs, "layer-by-layer").values
    plain = layer_entropy(seqs, "layer-by-layer", normalize="center-l2").values  # same preset...
    unclamped = layer_entropy(seqs, entropy_config("layer-by-layer", clamp_gram=False)).values
    np.testing.assert_allclose(plain, clamped)
    assert np.abs(clamped - unclamped).min() > 1e-3


def test_clamp_with_global_zscore_one_pass():
    """clamp_gram also applies in the one-pass z-score path (the d x d scatter is rebuilt, then clamped)."""
    seqs = prompts([40, 25, 6], 8, seed=2)
    rows = np.concatenate(seqs)
    mu, sd = rows.mean(0), rows.std(0, ddof=1) + 1e-5
    want = []
    for z in seqs:
        x = (z - mu) / sd
        K = np.maximum(x.T @ x if x.shape[0] > x.shape[1] else x @ x.T, 0.0)
        ev = np.linalg.eigvalsh(K)
        p = ev[ev > 0] / ev[ev > 0].sum()
        want.append(float(np.log((p**0.5).sum()) / 0.5))
    got = layer_entropy([torch.from_numpy(z) for z in seqs], entropy_config("lime", clamp_gram=True)).values
    np.testing.assert_allclose(got, want, atol=1e-8)


def test_flags_are_checked():
    with pytest.raises(ValueError, match="max_normalize must be True or False"):
        entropy_config("layer-by-layer", max_normalize=1)
    with pytest.raises(ValueError, match=r"log\(min\(t, d\)\) is 0"):
        layer_entropy([torch.randn(5, 1)], entropy_config("lime", max_normalize=True))
