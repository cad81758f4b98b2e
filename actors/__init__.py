"""Thin Ray actors over ssd's plain classes: the lease registry of the shared pool of draft workers
(lease_registry.py), a draft worker that serves targets over a connectable transport
(worker_actor.py), and the worker provider a target's PoolClient leases from
(leased_workers.py: `leased_workers`, passed to the engine as its worker_provider).

This package imports ssd; ssd never imports it: the engine is given the provider by its caller."""
