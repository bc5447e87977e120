"""The persistent batch: its sampling metadata is what the params say row by row, and its token and block rows,
kept only from the scheduler's diffs, are the scheduler's own view at every step (chunked prefill, prefix hits,
preemption and resumption, drafts with rejected ones trimmed), also across a pickle as a tensor-parallel rank
receives them."""

from __future__ import annotations

import pickle

import torch

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SchedulerConfig
from lmserve.request import Request, TokenLogprobs
from lmserve.sample.sampler import process_logits
from lmserve.sampling_params import SamplingParams
from lmserve.sched.output import NewRequestData
from lmserve.sched.scheduler import Scheduler
from lmserve.worker.input_batch import InputBatch
from lmserve.worker.inputs import build_inputs
from lmserve.worker.model_runner import RunnerOutput
from lmserve.worker.upload import to_device

V = 50
NEG_INF = float("-inf")
PARAMS = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=3),
          SamplingParams(top_p=0.8, min_p=0.1, logprobs=2), SamplingParams(repetition_penalty=1.2, min_tokens=4),
          SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3, logit_bias={7: 2.0, 9: -1.0}),
          SamplingParams(temperature=1.3, top_k=3, top_p=0.9)]


def reference(params: list[SamplingParams], outputs: list[list[int]], stop_ids: frozenset[int]) -> dict:
    """What each metadata field must hold, read from the params row by row (plain Python, no batch)."""
    ks = [p.top_k if not p.greedy and 0 < p.top_k < V else V for p in params]
    tps = [1.0 if p.greedy else p.top_p for p in params]
    rows = [i for i in range(len(params)) if ks[i] < V or tps[i] < 1.0]
    min_p = [0.0 if p.greedy else p.min_p for p in params]
    column = {name: [getattr(p, attr) for p in params] for name, attr in (
        ("repetition", "repetition_penalty"), ("frequency", "frequency_penalty"), ("presence", "presence_penalty"))}
    neutral = {"repetition": 1.0, "frequency": 0.0, "presence": 0.0}
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    ban = [(i, t) for i, (p, out) in enumerate(zip(params, outputs)) if len(out) < p.min_tokens for t in sorted(stop_ids)]
    return {
        "temperature": [1.0 if p.greedy else p.temperature for p in params], "greedy": [p.greedy for p in params],
        "filter_rows": rows if 0 < len(rows) < len(params) else None,
        "top_k": [ks[i] for i in rows] if any(ks[i] < V for i in rows) else None,
        "top_p": [tps[i] for i in rows] if any(tps[i] < 1.0 for i in rows) else None,
        "min_p": min_p if any(v > 0 for v in min_p) else None,
        **{name: [[v] for v in vals] if any(v != neutral[name] for v in vals) else None for name, vals in column.items()},
        "bias_values": [b for _, _, b in bias] or None, "bias_index": [[i for i, _, _ in bias], [t for _, t, _ in bias]],
        "ban_index": [[i for i, _ in ban], [t for _, t in ban]],
        "all_greedy": all(p.greedy for p in params), "all_random": not any(p.greedy for p in params),
        "max_top_k": max((ks[i] for i in rows), default=0) if any(ks[i] < V for i in rows) else 0,
        "max_num_logprobs": max((p.logprobs for p in params if p.logprobs is not None), default=None)}


def processed_reference(logits: torch.Tensor, params, prompts, outputs, stop_ids) -> torch.Tensor:
    """Bias, min_tokens ban and penalties applied one row at a time, as the sampler's docstring orders them."""
    out = logits.clone()
    for i, (p, prompt, gen) in enumerate(zip(params, prompts, outputs)):
        for t, b in (p.logit_bias or {}).items():
            out[i, t] += b
        if len(gen) < p.min_tokens:
            out[i, sorted(stop_ids)] = NEG_INF
        for t in set(prompt) | set(gen):
            out[i, t] = out[i, t] / p.repetition_penalty if out[i, t] > 0 else out[i, t] * p.repetition_penalty
        for t in set(gen):
            out[i, t] -= p.frequency_penalty * gen.count(t) + p.presence_penalty
    return out


def test_persistent_rows_equal_the_reference_metadata():
    prompts = [[1, 2, 3 + i] for i in range(len(PARAMS))]
    outputs = [[4, 4, 5][:i % 4] for i in range(len(PARAMS))]
    batch = InputBatch(V, torch.device("cpu"), capacity=2)  # grows while rows are added
    for i, p in enumerate(PARAMS):
        batch.add(NewRequestData(str(i), prompts[i], [], p, frozenset({0, 1}), p.seed))
    for i in range(len(PARAMS)):
        batch.accept(str(i), outputs[i])  # counts grow by accepted tokens only
    order = ["3", "0", "5", "1", "4", "2"]
    meta, gather, pending = to_device((*batch.metadata(order, [[]] * len(order)), batch.take_pending()), "cpu")
    batch.apply_pending(pending)
    batch.attach_counts(meta, gather)
    params = [PARAMS[int(r)] for r in order]
    ref = reference(params, [outputs[int(r)] for r in order], frozenset({0, 1}))
    for name in ("temperature", "greedy", "filter_rows", "top_k", "top_p", "min_p", "repetition", "frequency",
                 "presence", "bias_values"):
        a, b = getattr(meta, name), ref[name]
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, torch.tensor(b, dtype=a.dtype)), name
    for name in ("all_greedy", "all_random", "max_top_k", "max_num_logprobs"):
        assert getattr(meta, name) == ref[name], name
    for name in ("bias_index", "ban_index"):
        assert [t.tolist() for t in getattr(meta, name)] == ref[name], name
    # counts are kept only for rows that use a penalty (elsewhere they multiply a neutral value)
    penalised = [0, 4]  # requests "3" and "4" in this order
    for row in penalised:
        expected = torch.bincount(torch.tensor(outputs[int(order[row])], dtype=torch.int64), minlength=V).float()
        assert torch.equal(meta.output_counts[row], expected)
    seen = torch.zeros(V, dtype=torch.bool)
    seen[prompts[3]] = True
    assert torch.equal(meta.prompt_seen[0], seen)  # "3" uses the repetition penalty
    logits = torch.randn(len(order), V, generator=torch.Generator().manual_seed(0))
    expected = processed_reference(logits, params, [prompts[int(r)] for r in order], [outputs[int(r)] for r in order],
                                   frozenset({0, 1}))
    assert torch.allclose(process_logits(logits.clone(), meta), expected, atol=1e-6, rtol=0)
    assert [i for i, _ in meta.generators] == [3]  # the seeded sampling row, in this step's order
    batch.remove("3")
    batch.add(NewRequestData("6", [2], [], SamplingParams(frequency_penalty=1.0), frozenset(), None))
    assert batch.index["6"] == 3 and not batch.counts[3].any()  # a reused row starts with zero counts


# -- token and block rows from diffs -----------------------------------------------------------------

def _sampled(out, step: int, accepts: dict[str, int]) -> RunnerOutput:
    """A step's tokens: each verify run keeps accepts[rid] of its drafts (capped), then one new token."""
    ids = []
    for r in out.requests:
        if not r.sample:
            ids.append([])
            continue
        keep = min(accepts.get(r.request_id, 0), len(r.spec_token_ids))
        ids.append(r.spec_token_ids[:keep] + [100 + (step * 7 + len(ids)) % 50])
    return RunnerOutput(ids, [[TokenLogprobs(t, -1.0, []) for t in row] for row in ids])


def test_rows_kept_from_diffs_are_the_schedulers_view_at_every_step():
    """A small pool (preemptions), a small budget (chunked prefill), shared prompt prefixes (prefix hits) and
    drafts partly rejected (trimmed blocks): after each step's diffs, every scheduled request's row holds its
    tokens then its drafts and its whole block table, and the flat inputs are what whole lists would give."""
    kv = KVCacheManager(24, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=20), kv)
    shared = list(range(1, 13))  # three full blocks every prompt starts with
    for i in range(6):
        sched.add(Request(f"r{i}", shared + [20 + i] * (3 + 5 * i), SamplingParams(max_tokens=12), 12, frozenset()))
    rank = InputBatch(V, torch.device("cpu"), samples=False)  # a tensor-parallel worker's rows
    accepts = {"r0": 2, "r1": 0, "r2": 9, "r3": 1}
    seen = {"preempted": 0, "hits": 0, "trimmed": 0, "chunks": 0}
    for step in range(200):
        if not sched.has_unfinished():
            break
        for req in sched.running:  # drafts for the caught-up requests (the verifier decides)
            if req.num_computed_tokens == req.num_tokens - 1 and req.request_id in accepts:
                req.spec_token_ids = [30 + step % 5, 31, 32][:max(0, req.max_tokens - len(req.output_token_ids) - 1)]
        hits = kv.prefix_hits
        out = sched.schedule()
        sent = pickle.loads(pickle.dumps(out))  # what MultiprocExecutor sends a rank
        for rid in sent.finished_ids:
            rank.remove(rid)
        for new in sent.new_requests:
            rank.add(new)
        rank.apply(sent.requests)
        whole_ids = []
        for s in sent.requests:
            req, row = sched.requests[s.request_id], rank.index[s.request_id]
            known = req.num_tokens
            assert rank.tokens.array[row, :known].tolist() == req.all_token_ids
            assert rank.tokens.array[row, known:known + len(s.spec_token_ids)].tolist() == s.spec_token_ids
            assert rank.blocks.array[row, :rank.blocks.lens[row]].tolist() == kv.block_ids(s.request_id)
            whole_ids.append(req.all_token_ids[s.start_pos:s.start_pos + s.num_known] + s.spec_token_ids)
            seen["chunks"] += not s.sample
        if out.requests:
            host, layout = build_inputs(sent.requests, rank.index, rank.tokens, rank.blocks, 4)
            assert host.input_ids.tolist() == [t for j in layout.order for t in whole_ids[j]]
        seen["preempted"] += len(out.preempted_ids)
        seen["hits"] += kv.prefix_hits > hits
        before = {s.request_id: kv.num_blocks_of(s.request_id) for s in out.requests if s.spec_token_ids}
        sched.update(out, _sampled(out, step, accepts))
        seen["trimmed"] += sum(kv.num_blocks_of(rid) < n for rid, n in before.items() if rid in sched.requests)
    assert not sched.has_unfinished() and kv.num_free_blocks == 24
    assert all(n > 0 for n in seen.values()), seen  # every case above really happened
