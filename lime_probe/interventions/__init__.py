"""Interventions: forward passes that write activations (patch, ablate, steer) and LIMe router weights, and
gradients through them. `run_with_edits` is the one forward pass under edits; patching, attribution, route
ablation and steering are built on it. Importing this package imports nothing heavy."""
