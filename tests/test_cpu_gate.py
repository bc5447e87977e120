"""The gate between the models of a CPU server (worker/cpu_gate.py, layers/kernels/csrc/cpu_gate.h): an encoder's
short step holds it; a generative model's step pauses while it is held, at its start and at each layer of the
module loop and of the native decode stack, for at most its allowance in all; a paused step gives the same tokens.
How much it buys beside 8 chat streams is a benchmark's (benchmarks/retrieval_mixed.py), not a test's."""

from __future__ import annotations

import threading

import pytest

from lmserve import LLM, SamplingParams
from lmserve.layers.kernels.native import native_module
from lmserve.worker import cpu_gate
from tests.encoder_models import WORDS, build_encoder

pytestmark = pytest.mark.skipif(native_module() is None, reason="needs the native CPU kernels")


@pytest.fixture
def gate():
    return native_module()


def test_without_a_holder_a_step_never_waits(gate):
    assert gate.gate_begin_step(10_000_000) == 0
    assert gate.gate_pause() == 0
    assert gate.gate_end_step() == 0


def test_after_its_step_a_thread_never_waits(gate):
    gate.gate_begin_step(10_000_000)
    gate.gate_end_step()
    gate.gate_hold()
    try:
        assert gate.gate_pause() == 0  # outside a step (a warm-up's forward, a probe): no allowance left
    finally:
        gate.gate_release()


def test_a_step_waits_while_the_gate_is_held_and_goes_on_at_its_release(gate):
    waited = []
    gate.gate_hold()
    try:
        t = threading.Thread(target=lambda: waited.append((gate.gate_begin_step(60_000_000), gate.gate_end_step())))
        t.start()
        t.join(0.5)
        assert t.is_alive(), "the step went on while the gate was held"
    finally:
        gate.gate_release()
    t.join(10)
    assert not t.is_alive() and waited[0][0] >= 200_000 and waited[0][1] == waited[0][0]


def test_a_step_waits_at_most_its_allowance_in_all(gate):
    waits = []

    def step():
        waits.append(gate.gate_begin_step(50_000))
        waits.append(gate.gate_pause())  # the allowance is spent: no second wait in the same step
        waits.append(gate.gate_end_step())
        waits.append(gate.gate_end_step())  # a failed step's end after its own: its wait is not counted again

    gate.gate_hold()
    try:
        t = threading.Thread(target=step)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a held gate kept the step past its allowance"
    finally:
        gate.gate_release()
    assert waits[0] >= 50_000 and waits[1] == 0 and waits[2] == waits[0] and waits[3] == 0


class Counted:
    """The native decode stack, its calls counted (one a decode step that ran in it)."""

    def __init__(self, inner, calls: list[int]) -> None:
        self.inner, self.calls = inner, calls

    def __call__(self, *args, **kwargs):
        self.calls[0] += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_a_generative_step_pauses_at_a_layer_for_a_hold_that_began_inside_it_and_gives_the_same_tokens(offline_llm):
    """The hold begins after the step's start (a hook on the embedding, which runs before the layers), so only the
    layers' own checks can pause it: the module loop's pre-hook in the prompt's step, the native decode stack's
    check in the decode steps. Each step waits its whole allowance (nobody releases until the final norm)."""
    engine = offline_llm.engine
    assert engine.runner.decode_stack is not None, "the embedded model's decode steps run the native stack here"
    model = engine.loaded.model
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    reference = [o.outputs[0].token_ids for o in offline_llm.generate(prompts, params, use_tqdm=False)]
    mod, held, stack_steps = native_module(), [0], [0]

    def hold(*args):
        held[0] += 1
        mod.gate_hold()

    def release(*args):
        held[0] -= 1
        mod.gate_release()

    loop = next(m for m in model.modules() if getattr(m, "stack", None) is engine.runner.decode_stack)
    loop.stack = Counted(loop.stack, stack_steps)
    hooks = [model.model.embed_tokens.register_forward_hook(hold), model.model.norm.register_forward_pre_hook(release)]
    before, paused_s = cpu_gate.gate_stats(), engine.runner.gate.paused_s
    try:
        paused = [o.outputs[0].token_ids for o in offline_llm.generate(prompts, params, use_tqdm=False)]
    finally:
        loop.stack = loop.stack.inner
        for h in hooks:
            h.remove()
        for _ in range(held[0]):  # a step that raised between the two hooks: never leave the gate held
            mod.gate_release()
    after = cpu_gate.gate_stats()
    assert paused == reference
    steps = after["holds"] - before["holds"]
    assert steps >= 8 and stack_steps[0] >= 7  # a prompt step, then decode steps in the native stack, one a token
    assert after["pauses"] - before["pauses"] == steps
    waited = after["paused_us"] - before["paused_us"]
    assert waited >= steps * cpu_gate.PAUSE_PER_STEP_MS * 1000
    assert engine.runner.gate.paused_s - paused_s == pytest.approx(waited / 1e6)  # the engine's own count


def test_an_encoders_short_steps_hold_the_gate_and_its_long_ones_do_not(tmp_path):
    llm = LLM(str(build_encoder(tmp_path)), max_num_seqs=16, max_num_batched_tokens=2048)
    before = cpu_gate.gate_stats()["holds"]
    llm.embed(["the cat sat on the mat"], use_tqdm=False)
    assert cpu_gate.gate_stats()["holds"] == before + 1
    long = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(50)) for i in range(12)]
    assert sum(len(llm.engine.front.tokenize_prompt(s)) for s in long) > cpu_gate.URGENT_TOKENS
    llm.embed(long, use_tqdm=False)  # one step of ~620 tokens: bulk work shares the cores
    assert cpu_gate.gate_stats()["holds"] == before + 1


def test_a_failed_steps_allowance_ends_with_it(offline_llm, monkeypatch):
    """After step() raised, fail_step ends the gate's step on the engine's thread: a hold that comes later never
    pauses that thread (before, the failed step's unspent allowance was left to any check until the next step)."""
    engine = offline_llm.engine

    def boom(out):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.executor, "execute", boom)
    engine.add_request("failing", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    paused_s = engine.runner.gate.paused_s
    assert engine.fail_step() == ["failing"]
    assert engine.runner.gate.paused_s == paused_s  # it waited nothing; nothing of an earlier step counted again
    mod = native_module()
    mod.gate_hold()
    try:
        assert mod.gate_pause() == 0  # no step on this thread: no wait (would be the allowance, 50 ms, before)
    finally:
        mod.gate_release()
