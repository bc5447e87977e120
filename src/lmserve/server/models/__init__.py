"""The models a server serves: --model / --route flags (args.py), the pool that loads, evicts and leases them
(pool.py) and weighted traffic splits between them (traffic.py)."""
