"""Layer 5, runs of many analyses over many checkpoints: the embedded demo and the seeded studies."""
