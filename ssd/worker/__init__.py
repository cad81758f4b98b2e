"""The draft worker: a TreeDrafter serving targets over channels (session.py), and its process
(main.py: `run_forked`, forked by a target through ssd/transport/spawn.py) or a thread of a Ray
actor (serve_sessions)."""
