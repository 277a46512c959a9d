"""Layer 1, from checkpoint to activations: loading a model (`loading`), mapping its architecture to the
sites we read (`adapters`, `sites`), planning which module values a trace reads (`planning`), cutting text
into windows (`windows`), padding token id lists into batches (`batching`), tokenising texts and running
their batches (`tracing`), tracing one forward pass with nnsight (`forward`), the container of the results
(`activations`), and the on-disk activation cache (`cache`, `cachedir`, keyed on `provenance`).

Nothing here imports a probe, a plot or training code.
"""
