"""Draft worker: a small model proposing tokens for many sequences at once.

A Propose call (``service.py``) becomes a ``ProposeCall`` for the ``Batcher``;
``DraftEngine.run_batch`` (``engine.py``) brings each sequence's history up
to date (keep ``committed_len`` tokens, append ``new_tokens``) and asks the
``DraftModelProposer`` for all of them at once: one forward pass per decode
step, shared by every sequence in the batch.
"""
