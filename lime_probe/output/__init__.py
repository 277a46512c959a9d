"""Layer 3, what a user keeps: figures (`plots`: the style, saving and maps; `charts`: line and bar charts),
result files with their provenance (`results`) and the self-contained HTML report (`report`). Nothing here
runs a model or a probe.
"""
