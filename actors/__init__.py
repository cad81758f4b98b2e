"""Thin Ray actors over ssd's plain classes: the shared pool of draft workers and its leases
(draft_pool.py), a draft worker that serves targets over a connectable transport
(draft_worker.py), and the WorkerSource a target's DraftPool leases from (source.py).

This package imports ssd; ssd never imports it (the engine looks `actors.source` up by name
when draft_launcher resolves to "ray")."""
