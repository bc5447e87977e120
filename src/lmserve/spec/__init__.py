"""Speculative decoding: draft proposers, acceptance statistics and per-request back-off.

Verification itself lives in the sampler (sample/rejection.py) and KV rollback in the cache manager;
this package only decides which draft tokens each request carries into the next step.
"""
