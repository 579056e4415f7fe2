"""Self-distilled training of speculation heads (``tandem heads train`` / ``tandem heads prepare``).

The target labels its own text: each corpus token's label is what the target itself
would say next (the argmax of its logits), so the heads learn this target, not the text.
In order, one module each:

- ``sources``: where text comes from, with its licence; ``corpus``: seeded token sequences;
- ``features``: one pass of the target (Tandem's engine) writing shards of tokens, labels
  and hidden-state features; ``shards``: reading them back as batches fixed by the step;
- ``vocab``: the draft vocabulary; ``head_init``: heads started from the target's lm_head;
- ``medusa_train`` / ``eagle_train``: what each kind guesses on a batch (EAGLE with
  training-time test over a dense copy of its serving layer);
- ``trainer`` and ``checkpoints``: AdamW with exact resume; ``summary``: held-back accuracy;
- ``options``: the run's settings, validated; ``pipeline``: one run end to end.
"""
