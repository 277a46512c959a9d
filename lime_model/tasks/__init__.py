"""Synthetic tasks for training and evaluating LIMe models."""
