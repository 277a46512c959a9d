"""Probes of representation collapse for LIMe, LLaMA and any Hugging Face checkpoint."""
