"""Scheduler decisions without a model: token budget, chunking, FCFS admission, preemption, finishing."""

from lmserve.cache.kv_cache_manager import KVCacheManager
from lmserve.config import SchedulerConfig
from lmserve.request import BATCH_PRIORITY, Request, RequestStatus, TokenLogprobs
from lmserve.sampling_params import SamplingParams
from lmserve.sched.scheduler import Scheduler
from lmserve.worker.model_runner import RunnerOutput


def result(out, tokens: dict[str, int]) -> RunnerOutput:
    """The runner's output for `out`: one token for each listed request that samples this step."""
    ids = [[tokens[r.request_id]] if r.sample and r.request_id in tokens else [] for r in out.requests]
    return RunnerOutput(ids, [[TokenLogprobs(t, 0.0, []) for t in row] for row in ids])


def make(rid: str, n_prompt: int, max_tokens: int = 8, base: int = 0, priority: int = 0) -> Request:
    return Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens), max_tokens,
                   frozenset({0}), priority=priority)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, result(out, {r.request_id: token for r in out.requests}))
    return out


def test_chunked_prefill_within_token_budget_and_decodes_first():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), kv)
    s.add(make("a", 6))
    s.add(make("b", 9, base=100))
    out = step(s)
    assert [(r.request_id, r.num_tokens, r.start_pos, r.sample) for r in out.requests] == [
        ("a", 6, 0, True), ("b", 4, 0, False)]
    out = step(s)  # a decodes one token, b continues its prefill with the rest of the budget
    assert [(r.request_id, r.num_tokens, r.start_pos, r.sample) for r in out.requests] == [
        ("a", 1, 6, True), ("b", 5, 4, True)]
    assert s.requests["b"].output_token_ids == [7]


def test_no_chunking_waits_for_whole_prompt():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False), kv)
    s.add(make("a", 6))
    s.add(make("b", 9, base=100))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["a"]
    out = step(s)
    assert [(r.request_id, r.num_tokens) for r in out.requests] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_admission_fcfs():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), kv)
    for i in range(3):
        s.add(make(str(i), 3, base=10 * i))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_preempts_most_recent_when_blocks_run_out_and_recomputes():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), kv)
    s.add(make("a", 7, max_tokens=8))
    s.add(make("b", 7, max_tokens=8, base=50))
    step(s)  # prefill: a gets blocks 0,1 ; b gets 2,3
    step(s)  # decode of token 8 (position 7) still fits in two blocks each
    assert kv.block_ids("a") == [0, 1] and kv.block_ids("b") == [2, 3]
    out = step(s)  # position 8 needs a 3rd block: b (newest) is preempted, a continues
    assert out.preempted_ids == ["b"]
    assert [r.request_id for r in out.requests] == ["a"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.requests["b"].num_computed_tokens == 0
    assert kv.block_ids("a") == [0, 1, 2]  # b freed its blocks tail first: its first block (2) is reused first
    assert [r.request_id for r in s.waiting] == ["b"]
    while "a" in s.requests:
        step(s)
    out = step(s)  # b comes back and recomputes prompt + its 2 generated tokens in one chunk
    assert [(r.request_id, r.start_pos, r.num_tokens) for r in out.requests] == [("b", 0, 9)]


def test_stop_token_and_length_finish_and_free():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(), kv)
    s.add(make("a", 3, max_tokens=2))
    s.add(make("b", 3, max_tokens=5, base=20))
    out = s.schedule()
    s.update(out, result(out, {"a": 5, "b": 0}))  # b samples its stop id 0
    assert s.requests.get("b") is None
    out = s.schedule()
    s.update(out, result(out, {"a": 5}))
    assert not s.has_unfinished() and kv.num_free_blocks == 16


def test_min_tokens_defers_stop_token():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(), kv)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, min_tokens=2), 5, frozenset({0}))
    s.add(r)
    step(s, token=0)
    assert r.status == RequestStatus.RUNNING  # 1 token < min_tokens: eos does not stop it
    step(s, token=0)
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_abort_while_waiting_and_running_frees_everything():
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=1), kv)
    s.add(make("a", 5))
    s.add(make("b", 5))
    step(s)
    assert s.finish("a", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert s.finish("b", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("missing", RequestStatus.FINISHED_ABORTED) is None
    assert kv.num_free_blocks == 16 and not s.has_unfinished()


def tenant_request(rid: str, tenant: str, base: int, max_tokens: int = 8) -> Request:
    req = make(rid, 3, max_tokens=max_tokens, base=base)
    req.tenant = tenant
    return req


def test_admission_is_round_robin_across_tenants_and_fcfs_within_one():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=100), kv)
    for i in range(4):  # a's four requests arrive before b's and c's
        s.add(tenant_request(f"a{i}", "team-a", 10 * i))
    s.add(tenant_request("b0", "team-b", 100))
    s.add(tenant_request("b1", "team-b", 110))
    s.add(tenant_request("c0", "team-c", 200))
    out = step(s)
    assert [r.request_id for r in out.requests] == ["a0", "b0", "c0", "a1", "b1"]
    assert [r.request_id for r in s.waiting] == ["a2", "a3"]


def test_one_tenant_keeps_fcfs_order():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), kv)
    for i in range(4):
        s.add(tenant_request(str(i), "only", 10 * i))
    assert [r.request_id for r in step(s).requests] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2", "3"]


def test_tenant_holding_every_slot_gives_one_up_and_gets_it_back():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100), kv)
    for i in range(5):
        s.add(tenant_request(f"a{i}", "team-a", 10 * i, max_tokens=20))
    step(s)
    assert [r.request_id for r in s.running] == ["a0", "a1", "a2"]
    s.add(tenant_request("b0", "team-b", 100, max_tokens=2))
    out = step(s)  # a's newest running request makes room for b at once
    assert out.preempted_ids == ["a2"] and s.requests["a2"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in out.requests] == ["a0", "a1", "b0"]
    assert [r.request_id for r in s.waiting] == ["a2", "a3", "a4"]
    s.add(tenant_request("b1", "team-b", 110, max_tokens=2))
    out = step(s)  # a holds 2, b 1: a gap of one is fair, nobody is preempted
    assert out.preempted_ids == [] and "b1" not in [r.request_id for r in out.requests]
    while "b0" in s.requests:
        step(s)
    out = step(s)  # b0's slot: round-robin gives it to a (admitted less recently than b), its preempted one first
    assert s.requests.get("b1") is not None and "a2" in [r.request_id for r in s.running]
    assert kv.num_free_blocks + sum(len(kv.block_ids(r.request_id)) for r in s.running) == 64


def test_waiting_interactive_requests_are_admitted_before_waiting_batch_lines():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), kv)
    for i in range(3):
        s.add(make(f"batch{i}", 3, base=10 * i, priority=BATCH_PRIORITY))
    assert [r.request_id for r in step(s).requests] == ["batch0", "batch1"]
    s.add(make("chat", 3, base=50))  # arrives after batch2, and still takes the next free slot
    s.finish("batch0", RequestStatus.FINISHED_STOPPED)
    out = step(s)
    assert [r.request_id for r in out.new_requests] == ["chat"]
    assert [r.request_id for r in s.waiting] == ["batch2"]
    s.finish("batch1", RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r in step(s).new_requests] == ["batch2"]  # no interactive request waits: batch runs


def test_batch_lines_alone_are_admitted_fcfs():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100), kv)
    s.add(make("b0", 3, priority=BATCH_PRIORITY))
    s.add(make("b1", 3, base=10, priority=BATCH_PRIORITY))
    assert [r.request_id for r in step(s).new_requests] == ["b0"]
    s.finish("b0", RequestStatus.FINISHED_STOPPED)
    assert [r.request_id for r in step(s).new_requests] == ["b1"]


# -- bidirectional image spans (Gemma 3): never split, and never past the step's budget ----------------------------

def image_request(rid: str, n_prompt: int, span: tuple[int, int], tenant: str, base: int = 0) -> Request:
    import numpy as np

    from lmserve.multimodal.processor import MMInput

    mm = MMInput(rid, np.zeros(1, np.float32), np.arange(*span), bidirectional=True)
    req = make(rid, n_prompt, max_tokens=3, base=base)
    req.mm_inputs, req.tenant = (mm,), tenant
    return req


def run_all(s: Scheduler, limit: int = 50) -> list:
    steps = []
    while s.has_unfinished() and len(steps) < limit:
        steps.append(step(s))
    assert not s.has_unfinished()
    return steps


def chunks_of(steps, rid: str) -> list[tuple[int, int]]:
    return [(r.start_pos, r.start_pos + r.num_known) for out in steps for r in out.requests if r.request_id == rid]


def test_an_image_span_waits_for_room_and_no_step_passes_the_budget():
    """Two tenants share a 10-token budget 5/5; the image's 8-token span [6, 14) starts a chunk when the image
    request's share is 5: it would have run whole past the budget (13 tokens); it is granted first and whole, and the
    text request takes what is left."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv)
    s.add(image_request("img", 24, (6, 14), "a"))
    txt = make("txt", 30, max_tokens=3, base=100)  # a 30-token prompt: it wants its whole share every step
    txt.tenant = "b"
    s.add(txt)
    steps = run_all(s)
    assert all(sum(r.num_known + len(r.spec_token_ids) for r in out.requests) <= 10 for out in steps)
    img = chunks_of(steps, "img")
    assert not any(6 < end < 14 for _, end in img)  # no chunk ends inside the span
    assert (6, 14) in img  # the span ran as one chunk
    assert sum(r.request_id == "txt" for out in steps for r in out.requests if r.start_pos < 30) >= 4  # txt went on


def test_two_spans_that_do_not_fit_one_step_take_turns():
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv)
    s.add(image_request("i1", 12, (0, 8), "a"))
    s.add(image_request("i2", 12, (0, 8), "b", base=50))
    steps = run_all(s)
    assert all(sum(r.num_known for r in out.requests) <= 10 for out in steps)
    assert [(0, 8)] == chunks_of(steps, "i1")[:1] == chunks_of(steps, "i2")[:1]
    first = [out for out in steps for r in out.requests if r.start_pos == 0]
    assert first[0] is not first[1]  # 8 + 8 > 10: the second span waited a step


def test_a_span_longer_than_the_budget_runs_alone():
    """An 18-token span under a 10-token budget could never fit: its request runs alone for one step (others wait
    that step), and every other step keeps the budget."""
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), kv)
    s.add(make("dec", 3, max_tokens=12, base=100))
    step(s)  # dec is decoding
    s.add(image_request("img", 24, (2, 20), "a"))
    steps = run_all(s)
    big = [out for out in steps if sum(r.num_known for r in out.requests) > 10]
    assert [[(r.request_id, r.start_pos, r.num_known) for r in out.requests] for out in big] == [[("img", 2, 18)]]
    assert all(sum(r.num_known for r in out.requests) <= 10 for out in steps if out not in big)
    assert not any(2 < end < 20 for _, end in chunks_of(steps, "img"))
