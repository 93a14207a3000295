"""Chapter 00 — the model and data every chapter shares: a tiny GPT-2 and a Markov corpus with a
known loss floor."""
from .data import MarkovCorpus
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "MarkovCorpus"]
