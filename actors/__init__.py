"""Thin Ray actors over ssd's plain classes: the lease registry of the shared pool of draft workers
(lease_registry.py), a draft worker that serves targets over a connectable transport
(worker_actor.py), the worker provider a target's PoolClient leases from (leased_workers.py:
`leased_workers`, passed to the engine as its worker_provider), and a tensor-parallel target's
ranks as actors in its placement group (tp_ranks.py: `RayRanks`, passed as its rank_launcher).

This package imports ssd; ssd never imports it: the engine is given the provider and the launcher
by its caller."""
