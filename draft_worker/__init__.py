"""Draft worker: a small model proposing tokens for many sequences at once.

A Propose call (``service.py``) becomes a ``ProposeCall`` for the ``Batcher``;
``DraftEngine.run_batch`` (``engine.py``) brings each sequence's tokens up to
date (keep ``committed_len``, append ``new_tokens``, roll the KV back to what
still agrees) and drafts for all of them at once: one forward pass per decode
step, shared by every sequence in the batch. Sampled drafts come with the
wire messages of the q each token was drawn from.
"""
