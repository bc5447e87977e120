"""Test-only fault injection: make one engine step fail, to test recovery end to end. Off in production.

`LMSERVE_TEST_FAULT` is read once, when the server starts its engine thread (after warm-up):
  unset or empty   nothing is installed (production): the runner is not wrapped, no step pays anything
  "step:N"         the N-th forward after warm-up raises InjectedFault (an Exception): one failed step
  "step:N:K"       forwards N .. N+K-1 raise: K failed steps in a row
  "every:N"        forwards N, 2N, 3N, ... raise: each of a run of requests, sent one after another, fails part-way
  "thread:N"       the N-th forward raises InjectedFatalFault (a BaseException): the engine thread dies
  "hang:N"         the N-th forward never returns (a deadlock or stuck kernel): the watchdog's case
  "slow:N:MS"      every decoder layer of the N-th forward starts MS ms late: a long step that makes progress (a
                   slow host), which the watchdog must let run

Never reachable from HTTP: an environment variable of the server process is fixed when the process
starts; no route, header or body field can set one, and it is read only before the first request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from torch import nn

from lmserve.worker.progress import decoder_layers

log = logging.getLogger(__name__)

ENV_TEST_FAULT = "LMSERVE_TEST_FAULT"


class InjectedFault(RuntimeError):
    """A failure of one step (as a CUDA error or a bug on one batch would be)."""


class InjectedFatalFault(BaseException):
    """A failure the engine thread cannot catch per step (BaseException): the thread dies."""


@dataclass(frozen=True)
class FaultSpec:
    """Which forwards after warm-up fail, and how."""

    kind: str  # "step" or "every" (raise an Exception), "thread" (a BaseException), "hang" (block forever) or "slow"
    first: int  # 1-based forward count
    count: int = 1
    delay_ms: int = 0  # "slow": how late each decoder layer starts

    def hits(self, n: int) -> bool:
        if self.kind == "every":
            return n % self.first == 0
        return self.first <= n < self.first + self.count


# kind -> how many numbers follow it (fewest, most)
_NUMS = {"step": (1, 2), "every": (1, 1), "thread": (1, 1), "hang": (1, 1), "slow": (2, 2)}


def parse_fault(value: str) -> FaultSpec | None:
    """'step:N[:K]', 'thread:N', 'hang:N' or 'slow:N:MS' -> FaultSpec; '' -> None; anything else is a ValueError."""
    if not value:
        return None
    kind, *nums = value.split(":")
    low, high = _NUMS.get(kind, (1, 0))
    if not low <= len(nums) <= high or not all(x.isdigit() and int(x) > 0 for x in nums):
        raise ValueError(f"{ENV_TEST_FAULT}={value!r}: expected 'step:N', 'step:N:K', 'every:N', 'thread:N', "
                         "'hang:N' or 'slow:N:MS' (N, K, MS >= 1)")
    if kind == "slow":
        return FaultSpec(kind, int(nums[0]), delay_ms=int(nums[1]))
    return FaultSpec(kind, *map(int, nums))


def install_from_env(engine) -> FaultSpec | None:
    """Wrap `engine.runner.execute` as $LMSERVE_TEST_FAULT says (nothing when unset); returns the spec."""
    spec = parse_fault(os.environ.get(ENV_TEST_FAULT, "").strip())
    if spec is not None:
        log.warning("%s is set: injecting engine faults (test only)", ENV_TEST_FAULT)
        slow = _late_layers(engine.runner.model, spec.delay_ms) if spec.kind == "slow" else None
        engine.runner.execute = _faulty(engine.runner.execute, spec, slow)
    return spec


def _faulty(execute, spec: FaultSpec, slow: threading.Event | None = None):
    """`execute` that raises on the forwards `spec` names, before running them (or, `slow`, runs them late)."""
    calls = 0

    def run(out):
        nonlocal calls
        calls += 1
        if spec.hits(calls) and slow is not None:
            slow.set()
            try:
                return execute(out)
            finally:
                slow.clear()
        if spec.hits(calls):
            if spec.kind == "hang":
                threading.Event().wait()  # never set: this forward never returns
            raise (InjectedFatalFault if spec.kind == "thread" else InjectedFault)(f"injected fault in forward {calls}")
        return execute(out)

    return run


def _late_layers(model: nn.Module, delay_ms: int) -> threading.Event:
    """Make every decoder layer start `delay_ms` late while the returned event is set."""
    on = threading.Event()

    def late(module: nn.Module, args: object) -> None:
        if on.is_set():
            time.sleep(delay_ms / 1000)

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(late)
    return on
