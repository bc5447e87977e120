"""A tool call repeating an earlier one ends the request before it (engine/repeat_stop.py), streamed as whole."""

from __future__ import annotations

import random
import re

import pytest

from lmserve.engine.repeat_stop import RepeatedSpan, normalise
from lmserve.sampling_params import SamplingParams
from tests.test_engine import assert_no_leak, base, run  # noqa: F401 - base: the shared engine fixture

SPAN = ("<tool_call>", "</tool_call>")
CALL_A = '<tool_call>\n{"name": "f", "arguments": {"city": "Rome"}}\n</tool_call>'
CALL_A_SPACED = '<tool_call> {"name":"f",  "arguments":{"city":"Rome"}} </tool_call>'
CALL_B = '<tool_call>\n{"name": "f", "arguments": {"city": "Ro me"}}\n</tool_call>'


def reference_cut(text: str) -> int | None:
    """Where the first repeated span begins, by a regex over the whole text (the watcher's reference)."""
    seen = set()
    for m in re.finditer(re.escape(SPAN[0]) + ".*?" + re.escape(SPAN[1]), text, re.S):
        key = normalise(m.group())
        if key in seen:
            return m.start()
        seen.add(key)
    return None


def stream(text: str, pieces: list[int]) -> tuple[str, int | None]:
    """Feed `text` cut at `pieces` as the output processor does: (what was sent, where it stopped)."""
    watch, sent, cuts = RepeatedSpan(*SPAN), 0, [*pieces, len(text)]
    for end in cuts:
        at = watch.check(text[:end])
        if at is not None:
            assert sent <= at, "part of the repeat was streamed"
            return text[:at], at
        sent = max(sent, watch.held_from(text[:end]))
    return text, None


def test_normalise_keeps_whitespace_inside_strings_only():
    assert normalise(' {"a b" : [1, "x\\" y"] }\n') == '{"a b":[1,"x\\" y"]}'
    assert normalise(CALL_A) == normalise(CALL_A_SPACED) != normalise(CALL_B)


@pytest.mark.parametrize("text, cut", [
    (CALL_A + "\n" + CALL_A, len(CALL_A) + 1),
    (CALL_A + "\n" + CALL_A_SPACED + "\n" + CALL_A, len(CALL_A) + 1),  # whitespace aside, the same call
    (CALL_A + "\n" + CALL_B + "\n" + CALL_A, len(CALL_A + CALL_B) + 2),  # the first repeat, not the first pair
    (CALL_A + "\n" + CALL_B, None),  # "Ro me" is another argument: both are kept
    ("text " + CALL_A + " more text " + CALL_A[:-3], None),  # a repeat not complete yet is no repeat
])
def test_the_first_repeated_span_is_where_the_text_ends(text, cut):
    assert reference_cut(text) == cut
    assert stream(text, list(range(1, len(text)))) == (text[:cut] if cut is not None else text, cut)


def test_streaming_any_split_agrees_with_the_whole_text():
    rng = random.Random(7)
    calls = [CALL_A, CALL_B, CALL_A_SPACED, '<tool_call>{"x": "</tool"}</tool_call>', "plain <tool text"]
    for _ in range(300):
        text = "".join(rng.choice(calls) + rng.choice(["", "\n", " "]) for _ in range(rng.randint(1, 5)))
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        cut = reference_cut(text)
        assert stream(text, cuts) == (text[:cut] if cut is not None else text, cut)


def test_a_different_call_streams_once_it_differs():
    watch = RepeatedSpan(*SPAN)
    text = CALL_A + "\n" + CALL_B[:CALL_B.index("Ro me") + 3]  # "Ro ": differs from "Rome" at the space
    assert watch.check(text) is None and watch.held_from(text) == len(text)
    start = CALL_A + "\n" + CALL_A[:30]  # still a prefix of the first call: held from its begin
    assert watch.check(start) is None and watch.held_from(start) == len(CALL_A) + 1
    partial = CALL_A + "\n<tool"  # may become a begin: held
    assert watch.held_from(partial) == len(CALL_A) + 1


def test_the_engine_stops_before_a_repeated_call(base):  # noqa: F811
    """Greedy on a prompt of repeated calls repeats them; repeat_stop ends the output before the first repeat,
    and the deltas never carried any of it."""
    prompt = "Calls:\n" + "\n".join([CALL_A] * 4) + "\n"
    free = run(base, [prompt], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))["0"]
    cut = reference_cut(free["text"])
    assert cut is not None, f"the model did not repeat a call: {free['text']!r}"
    out = run(base, [prompt], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True,
                                             repeat_stop=SPAN))["0"]
    assert out["finish"] == "stop" and out["stop"] is None
    assert out["text"] == "".join(out["deltas"]) == free["text"][:cut]
    assert out["ids"] == free["ids"][:len(out["ids"])] and len(out["ids"]) < len(free["ids"])
    assert_no_leak(base)


@pytest.mark.parametrize("bad", [("<a>",), ("", "</a>"), ("<a>", 3)])
def test_repeat_stop_is_two_non_empty_strings(bad):
    with pytest.raises(ValueError, match="repeat_stop"):
        SamplingParams(repeat_stop=bad)
