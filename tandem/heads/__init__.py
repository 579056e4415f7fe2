"""Speculation heads on the target's own hidden states (Medusa, EAGLE-3): modules, files, drafting, training."""
