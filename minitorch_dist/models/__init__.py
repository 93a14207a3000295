"""Chapter 00 — the model and data every chapter shares: a tiny GPT-2, its Llama-shaped sibling (RMSNorm,
RoPE, SwiGLU, grouped-query attention) and a Markov corpus with a known loss floor."""
from .data import MarkovCorpus
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig", "MarkovCorpus"]
