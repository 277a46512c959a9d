"""Layer 2, the numerical probes: small functions on arrays of activations (matrix entropy, word
separability, BLiMP probes and minimal pairs, t-SNE, CKA, router weights) and the statistics the studies
report. They draw nothing; reading activations is `lime_probe.extraction`'s job.
"""
