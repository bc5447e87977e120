"""Speculative decoding: draft proposers, acceptance statistics and the draft policy
(how many drafts each request is worth, from its acceptance and measured step costs).

Verification itself lives in the sampler (sample/rejection.py) and KV rollback in the cache manager;
this package only decides which draft tokens each request carries into the next step.
"""
