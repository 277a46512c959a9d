"""LIMe (Layer-Integrated Memory) as a Hugging Face causal LM; `routing="none"` is the LLaMA baseline."""
