"""The native kernels' own worker pool (layers/kernels/csrc/thread_pool.h): any number of threads, any chunking, concurrent
callers and forked children give the single thread's bits; and a decode step's ~150 kernel calls cost no thread
wake-ups while the workers poll (what made one stream slow under OMP_WAIT_POLICY=PASSIVE)."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from lmserve.layers.kernels import native

mod = native.native_module()
# serial: the pool's wake-up and park counts are read under a quiet machine's scheduling; a test running beside it
# in the other xdist worker moves them (scripts/test.sh runs `serial` tests alone)
pytestmark = [pytest.mark.skipif(mod is None, reason="no C++ compiler here: the PyTorch path is used"),
              pytest.mark.serial]


def linear_case(rows: int, seed: int = 0):
    """A Q8_0-like S8 layer of 96 outputs over K = 320 in the row layout (any build runs it), and its input."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (96, 320), generator=g, dtype=torch.int8)
    scales = torch.rand(96, 320 // 16, generator=g) / 50
    return torch.randn(rows, 320, generator=g), codes, scales


def kernels(x, codes, scales, q, cache, tables, lens):
    return (mod.quant_linear(x, codes, scales, None, 2, None),
            mod.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.125),
            mod.silu_and_mul(x[:, :320].repeat(1, 64)), mod.quantize_activations(x.repeat(1, 4)))


def attention_case(batch: int):
    g = torch.Generator().manual_seed(batch)
    cache = torch.randn(2, 4 * batch, 16, 3, 64, generator=g).half()
    tables = torch.randperm(4 * batch, generator=g).view(batch, 4)
    return torch.randn(batch, 9, 64, generator=g), cache, tables, torch.randint(1, 65, (batch,), generator=g)


@pytest.fixture
def threads():
    """torch.set_num_threads, with the pool held to that count (its machine-driven policy off) until the test ends."""
    before, tuning = torch.get_num_threads(), mod.pool_tuning()
    mod.set_pool_tuning(**{**tuning, "adaptive": 0})
    yield torch.set_num_threads
    mod.set_pool_tuning(**tuning)
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 3, 40, 200])
def test_results_do_not_depend_on_the_thread_count(threads, rows):
    """1, 2, 3 and 5 threads (more than this machine's cores: workers get descheduled mid-job) cut the same kernels
    into different chunks; every output is the same bits."""
    args = (*linear_case(rows), *attention_case(rows))
    threads(1)
    reference = kernels(*args)
    for n in (2, 3, 5):
        threads(n)
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(kernels(*args), reference)), n


def test_concurrent_callers_get_their_own_results(threads):
    """Python threads calling kernels at once (the decode stack runs without the GIL): one uses the pool, the others
    run inline; none sees another's job."""
    threads(2)
    cases = [(*linear_case(rows, seed=rows), *attention_case(rows)) for rows in (1, 7, 33, 64)]
    expected = [kernels(*c) for c in cases]
    failures = []

    def hammer(i: int) -> None:
        for _ in range(20):
            if not all(torch.equal(a, b) for a, b in zip(kernels(*cases[i]), expected[i])):
                failures.append(i)

    workers = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures


def _child(queue) -> None:
    torch.set_num_threads(2)
    x, codes, scales = linear_case(33)
    queue.put(mod.quant_linear(x, codes, scales, None, 2, None).numpy().tobytes())  # bytes: no shared-memory handle


def test_a_forked_child_starts_its_own_workers(threads):
    threads(2)
    x, codes, scales = linear_case(33)
    expected = mod.quant_linear(x, codes, scales, None, 2, None)  # the parent's workers exist now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    got = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0 and got == expected.numpy().tobytes()


def test_errors_inside_a_job_reach_the_caller(threads):
    threads(2)
    x, codes, scales = linear_case(40)
    with pytest.raises(RuntimeError, match="kind"):
        mod.quant_linear(x, codes, scales, None, 7, None)
    assert torch.equal(mod.quant_linear(x, codes, scales, None, 2, None), mod.quant_linear(x, codes, scales, None, 2, None))


@pytest.mark.parametrize("cpus,others,requested,plan", [
    (2, 0.0, 2, (2, True)), (2, 0.3, 2, (2, True)),    # idle, or a client taking a little: every thread, polling
    (2, 1.0, 2, (1, False)), (2, 0.7, 2, (1, False)),  # one busy neighbour: the caller alone, as one sleeping thread
    (2, 1.9, 2, (1, False)), (16, 12.2, 16, (4, False)), (16, 0.2, 8, (8, True)),
    (2, 0.0, 5, (5, True)), (2, 1.2, 5, (1, False))])  # more threads than cores: the user's choice on an idle machine
def test_the_thread_plan_follows_the_cores_others_keep_busy(cpus, others, requested, plan):
    assert mod.pool_plan(cpus, others, requested) == plan


def test_the_machine_watch_reads_this_machine():
    """The watch's view after a few jobs: this process's usable CPUs, others' busy cores within them."""
    x, codes, scales = linear_case(200)
    for _ in range(3):
        mod.quant_linear(x, codes, scales, None, 2, None)
        time.sleep(0.3)
    view = mod.pool_machine()
    assert view["cpus"] == len(os.sched_getaffinity(0)) and 0.0 <= view["others_cores"] <= view["cpus"] + 0.5
    expected = mod.pool_plan(view["cpus"], view["others_cores"], torch.get_num_threads())
    assert (view["threads"], view["poll"]) == expected


def test_a_decode_step_costs_no_wake_ups_while_workers_poll(threads):
    """The embedded model's batch-1 decode step runs ~150 pool jobs; with the workers polling between jobs (here for
    10 s, so that a loaded test machine cannot make them park), the steps after the first wake nobody."""
    from lmserve.config import CacheConfig, EngineConfig
    from lmserve.engine.llm_engine import LLMEngine
    from lmserve.sampling_params import SamplingParams

    threads(2)
    eng = LLMEngine(EngineConfig(quantization="gguf", num_threads=2, cache=CacheConfig(num_blocks=32)))
    eng.add_request("a", [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    eng.step()
    eng.step()
    saved = mod.pool_tuning()
    mod.set_pool_tuning(**{**saved, "worker_poll_us": 10_000_000, "caller_spin_us": 10_000_000, "adaptive": 0})
    try:
        # The worker may be parked from before the new tuning: one step wakes it. The caller counts a wake-up for
        # every job it starts while the woken worker has not yet run (a slow host takes a few jobs to schedule it),
        # so the count starts once the worker is surely up and polling.
        eng.step()
        time.sleep(0.1)
        before, steps = mod.pool_stats(), 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
        after = mod.pool_stats()
    finally:
        mod.set_pool_tuning(**saved)
    jobs = after["jobs"] - before["jobs"]
    assert steps >= 8 and jobs >= 100 * steps
    assert after["wakeups"] - before["wakeups"] <= 1 and after["caller_parks"] == before["caller_parks"]
