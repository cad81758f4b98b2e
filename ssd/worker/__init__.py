"""The draft worker: a TreeDrafter serving targets over channels (session.py), and its process
(main.py, `python -m ssd.worker`), started by a target (ssd/transport/spawn.py) or run in a
thread of a Ray actor (serve_sessions)."""
