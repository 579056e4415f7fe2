"""Our own decoder implementations (Llama and Qwen2 families) and their weight loading."""

from tandem.models.transformer import CausalLM
from tandem.models.weights import load_model

__all__ = ["CausalLM", "load_model"]
