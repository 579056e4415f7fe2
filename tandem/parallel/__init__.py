"""Tensor-parallel target workers: N ranks, one device each, one model split between them.

Rank 0 is the worker everyone sees (gRPC, scheduling, KV bookkeeping); ranks 1..N-1
are its child processes and run each forward pass on their shard when rank 0 says so:

* ``step.py``: the per-step protocol (what rank 0 broadcasts before each forward pass);
* ``ranks.py``: starting the ranks, their process groups, and watching them (a dead or
  hung rank fails the whole worker, which exits so that it is restarted);
* ``follower.py``: the loop of ranks 1..N-1;
* ``engine.py``: rank 0's ``ModelEngine``, which broadcasts each step before computing it.

The sharding itself is ``tandem.models.tensor_parallel``; the model code knows nothing of it.
"""
