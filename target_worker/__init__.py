"""Target worker: the large model; batched Prefill and Verify with KV rollback.

How a Verify call becomes a forward pass and a reply:
``service.py`` turns the request into a ``VerifyCall`` (draft_probs still as
wire messages) and submits it to the ``Batcher``; the batcher hands every
call waiting at that moment to ``TargetEngine.run_batch`` (``engine.py``) on
its model thread, which checks every call and decodes its draft_probs before
changing anything, then rolls each admitted sequence back to its committed
length, runs ONE ``ModelEngine.forward`` over all of them (last committed
token + k drafts each), applies the rejection sampler per sequence, trims
the KV to the accepted prefix, and returns a ``Verdict`` per call;
``service.py`` encodes it as a ``VerifyResponse``. Release goes through the
batcher too (``ReleaseCall``).
"""
