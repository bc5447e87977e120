"""Drift detection: does today's traffic still look like the reference traffic?

Each successful request becomes a small feature vector:
  numeric      prompt_tokens, output_tokens, mean_logprob (per generated token), prompt_chars, the fractions
               of letters / digits / whitespace / punctuation / non-ASCII characters in the prompt text,
               temperature and max_tokens as sent (absent parameters are left out, not guessed);
  categorical  finish_reason (of the first completion), route, script (the prompt's dominant writing
               system: latin, cyrillic_greek, cjk, arabic_hebrew, indic, other, none), stream, sampling
               (greedy / sampled / default), uses_stop.
The reference profile holds, per numeric feature, quantile bin edges (10 bins) and a capped sample;
per categorical feature, category frequencies. It comes from `lmserve monitor profile payload.jsonl`
or from the first N requests the server sees (`--drift-capture N`). The last `window` requests are
compared with it: population stability index per feature (over the reference bins, or categories)
and, for numeric features, the two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value.
A feature has drifted when its PSI is above the threshold (0.2 is the usual "significant shift").
Numbers are computed when asked (report, or a Prometheus scrape), so observe() stays O(1).
"""

from __future__ import annotations

import json
import math
import random
import sys
import unicodedata
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from lmserve.ops.record import RequestRecord, prompt_text

NUMERIC = ("prompt_tokens", "output_tokens", "mean_logprob", "prompt_chars", "frac_letters", "frac_digits",
           "frac_whitespace", "frac_punct", "frac_non_ascii", "temperature", "max_tokens")
CATEGORICAL = ("finish_reason", "route", "script", "stream", "sampling", "uses_stop")
FEATURES = NUMERIC + CATEGORICAL  # a closed set: the only values of the `feature` label
NUM_BINS = 10
MAX_SAMPLE = 5000  # reference values kept per numeric feature (a reservoir when there are more)
EPS = 1e-4  # floor for empty bins in PSI
PROFILE_VERSION = 1


# -- features -------------------------------------------------------------------------------------


def features(rec: Mapping[str, Any]) -> dict[str, float | str]:
    """The feature vector of one request, from a record dict (RequestRecord.to_dict() or a payload-log line)."""
    params = rec.get("params") or {}
    text = prompt_text(rec.get("prompt"), rec.get("messages"))
    outputs = rec.get("outputs") or []
    f: dict[str, float | str] = {
        "prompt_tokens": float(rec.get("prompt_tokens") or 0),
        "output_tokens": float(rec.get("output_tokens") or sum(o.get("tokens", 0) for o in outputs)),
        "prompt_chars": float(len(text)),
        "finish_reason": str(outputs[0].get("finish_reason")) if outputs else "none",
        "route": str(rec.get("route") or "unknown"),
        "script": script_of(text),
        "stream": str(bool(params.get("stream", False))).lower(),
        "uses_stop": str(bool(params.get("stop") or params.get("stop_sequences"))).lower(),
    }
    f.update(_char_classes(text))
    if isinstance(rec.get("mean_logprob"), (int, float)):
        f["mean_logprob"] = float(rec["mean_logprob"])
    temperature = params.get("temperature")
    if isinstance(temperature, (int, float)):
        f["temperature"] = float(temperature)
    f["sampling"] = "default" if temperature is None else "greedy" if temperature == 0 else "sampled"
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    if isinstance(max_tokens, (int, float)):
        f["max_tokens"] = float(max_tokens)
    return f


def _char_classes(text: str) -> dict[str, float]:
    n = len(text) or 1
    letters = digits = spaces = punct = non_ascii = 0
    for ch in text:
        if ch.isalpha():
            letters += 1
        elif ch.isdigit():
            digits += 1
        elif ch.isspace():
            spaces += 1
        elif unicodedata.category(ch)[0] in "PS":
            punct += 1
        non_ascii += ord(ch) > 127
    return {"frac_letters": letters / n, "frac_digits": digits / n, "frac_whitespace": spaces / n,
            "frac_punct": punct / n, "frac_non_ascii": non_ascii / n}


_SCRIPTS = ((0x0000, 0x024F, "latin"), (0x0370, 0x052F, "cyrillic_greek"), (0x0590, 0x06FF, "arabic_hebrew"),
            (0x0750, 0x08FF, "arabic_hebrew"), (0x0900, 0x0DFF, "indic"), (0x1E00, 0x1EFF, "latin"),
            (0x3040, 0x30FF, "cjk"), (0x3400, 0x9FFF, "cjk"), (0xAC00, 0xD7AF, "cjk"), (0xF900, 0xFAFF, "cjk"))


def script_of(text: str) -> str:
    """The writing system most of the prompt's letters belong to."""
    counts: Counter[str] = Counter()
    for ch in text[:2000]:
        if ch.isalpha():
            cp = ord(ch)
            counts[next((name for lo, hi, name in _SCRIPTS if lo <= cp <= hi), "other")] += 1
    return counts.most_common(1)[0][0] if counts else "none"


# -- the reference profile ------------------------------------------------------------------------


def build_profile(records: Iterable[Mapping[str, Any]], source: str = "records", seed: int = 0) -> dict:
    """A JSON-able reference profile from record dicts (only successful requests count)."""
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {name: [] for name in NUMERIC}
    seen: Counter[str] = Counter()
    cats: dict[str, Counter[str]] = {name: Counter() for name in CATEGORICAL}
    n = 0
    for rec in records:
        if rec.get("status", 200) != 200:
            continue
        n += 1
        for name, value in features(rec).items():
            if name in samples:
                seen[name] += 1
                _reservoir(samples[name], float(value), seen[name], rng)
            elif name in cats:
                cats[name][str(value)] += 1
    numeric = {}
    for name, values in samples.items():
        if values:
            arr = np.asarray(values, dtype=np.float64)
            edges = np.unique(np.quantile(arr, np.linspace(0, 1, NUM_BINS + 1)[1:-1]))
            numeric[name] = {"edges": edges.tolist(), "sample": sorted(values), "mean": float(arr.mean()),
                             "count": seen[name]}
    categorical = {name: {k: v / sum(c.values()) for k, v in c.items()} for name, c in cats.items() if c}
    return {"version": PROFILE_VERSION, "source": source, "samples": n, "numeric": numeric,
            "categorical": categorical}


def _reservoir(sample: list[float], value: float, seen: int, rng: random.Random) -> None:
    if len(sample) < MAX_SAMPLE:
        sample.append(value)
    else:
        j = rng.randrange(seen)
        if j < MAX_SAMPLE:
            sample[j] = value


def check_profile(profile: Any) -> dict:
    """The profile, or ValueError saying what is wrong with it."""
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        raise ValueError(f"drift reference: expected a profile with version {PROFILE_VERSION} "
                         "(made by `lmserve monitor profile payload.jsonl`)")
    for key in ("numeric", "categorical"):
        if not isinstance(profile.get(key), dict):
            raise ValueError(f"drift reference: missing {key!r} section")
    for name, spec in profile["numeric"].items():
        ok = isinstance(spec, dict) and isinstance(spec.get("edges"), list) and isinstance(spec.get("sample"), list) \
            and spec["sample"] and all(isinstance(x, (int, float)) for x in spec["edges"] + spec["sample"])
        if not ok:
            raise ValueError(f"drift reference: numeric feature {name!r} needs 'edges' and a non-empty 'sample'")
    for name, freqs in profile["categorical"].items():
        if not isinstance(freqs, dict) or not all(isinstance(v, (int, float)) for v in freqs.values()):
            raise ValueError(f"drift reference: categorical feature {name!r} needs category frequencies")
    return profile


# -- statistics -----------------------------------------------------------------------------------


def psi(expected: np.ndarray, actual: np.ndarray) -> float:
    """Population stability index of two distributions over the same bins (fractions; empty bins floored)."""
    e = np.maximum(expected, EPS)
    a = np.maximum(actual, EPS)
    return float(np.sum((a - e) * np.log(a / e)))


def numeric_psi(reference: Mapping[str, Any], values: np.ndarray) -> float:
    edges = np.asarray(reference["edges"], dtype=np.float64)
    bins = len(edges) + 1
    ref = np.bincount(np.searchsorted(edges, np.asarray(reference["sample"]), side="right"), minlength=bins)
    cur = np.bincount(np.searchsorted(edges, values, side="right"), minlength=bins)
    return psi(ref / ref.sum(), cur / cur.sum())


def categorical_psi(reference: Mapping[str, float], values: list[str]) -> float:
    counts = Counter(v if v in reference else "__other__" for v in values)
    cats = list(reference) + ["__other__"]
    e = np.array([reference.get(c, 0.0) for c in cats])
    a = np.array([counts.get(c, 0) for c in cats], dtype=np.float64) / max(len(values), 1)
    return psi(e / e.sum(), a)


def ks_2samp(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic and asymptotic two-sided p-value."""
    x, y = np.sort(x), np.sort(y)
    grid = np.concatenate([x, y])
    d = float(np.max(np.abs(np.searchsorted(x, grid, side="right") / len(x)
                            - np.searchsorted(y, grid, side="right") / len(y))))
    en = math.sqrt(len(x) * len(y) / (len(x) + len(y)))
    lam = (en + 0.12 + 0.11 / en) * d  # Stephens' correction for finite samples
    if lam < 1e-3:
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


# -- the monitor ----------------------------------------------------------------------------------


class DriftMonitor:
    """A rolling window of recent requests' features compared with a reference profile."""

    def __init__(self, reference: dict | None = None, capture: int = 0, window: int = 500, threshold: float = 0.2,
                 min_samples: int = 50, registry: CollectorRegistry | None = None) -> None:
        if reference is None and capture <= 0:
            raise ValueError("drift monitoring needs a reference profile or a capture count > 0")
        if window < 1 or threshold <= 0:
            raise ValueError("drift window must be >= 1 and threshold > 0")
        self.reference = check_profile(reference) if reference is not None else None
        self.capture, self.threshold = capture, threshold
        self.min_samples = min(min_samples, window)
        self._captured: list[dict] = []
        self.window: deque[dict[str, float | str]] = deque(maxlen=window)
        if registry is not None:
            registry.register(_DriftCollector(self))

    def observe(self, record: RequestRecord) -> None:
        if record.status != 200:
            return
        if self.reference is None:
            self._captured.append(record.to_dict())
            if len(self._captured) >= self.capture:
                self.reference = build_profile(self._captured, source=f"first {self.capture} requests")
                self._captured = []
            return
        self.window.append(features(record.to_dict()))

    def report(self) -> dict:
        """The JSON report of GET /v1/monitoring/drift."""
        head = {"threshold": self.threshold, "window": {"size": self.window.maxlen, "samples": len(self.window)}}
        if self.reference is None:
            return {"status": "capturing", "reference": {"source": "capturing", "samples": len(self._captured),
                                                         "target": self.capture}, **head, "features": {},
                    "drifted": []}
        ref = {"source": self.reference.get("source"), "samples": self.reference.get("samples")}
        if len(self.window) < self.min_samples:
            return {"status": "insufficient_data", "reference": ref, **head, "features": {}, "drifted": [],
                    "min_samples": self.min_samples}
        feats = self._compare()
        drifted = [name for name, f in feats.items() if f["drift"]]
        return {"status": "drift" if drifted else "ok", "reference": ref, **head, "features": feats,
                "drifted": drifted}

    def _compare(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        rows = list(self.window)
        for name, spec in self.reference["numeric"].items():
            values = np.array([r[name] for r in rows if name in r], dtype=np.float64)
            if len(values) < self.min_samples or name not in NUMERIC:
                continue
            p = numeric_psi(spec, values)
            d, pvalue = ks_2samp(np.asarray(spec["sample"], dtype=np.float64), values)
            out[name] = {"psi": p, "ks_statistic": d, "ks_pvalue": pvalue, "drift": p > self.threshold,
                         "reference_mean": spec.get("mean"), "window_mean": float(values.mean())}
        for name, freqs in self.reference["categorical"].items():
            if name not in CATEGORICAL:
                continue
            values = [str(r[name]) for r in rows if name in r]
            p = categorical_psi(freqs, values)
            out[name] = {"psi": p, "drift": p > self.threshold, "reference": freqs,
                         "window": {k: v / len(values) for k, v in Counter(values).items()}}
        return out


class _DriftCollector:
    """lmserve:drift_* gauges, computed at scrape time from the current window."""

    def __init__(self, monitor: DriftMonitor) -> None:
        self.monitor = monitor

    def collect(self):
        report = self.monitor.report()
        psi_g = GaugeMetricFamily("lmserve:drift_psi", "Population stability index, window vs reference",
                                  labels=["feature"])
        ks_g = GaugeMetricFamily("lmserve:drift_ks_statistic", "Two-sample KS statistic, window vs reference",
                                 labels=["feature"])
        flag = GaugeMetricFamily("lmserve:drift_detected", "1 when the feature's PSI is above the threshold",
                                 labels=["feature"])
        for name, f in report["features"].items():
            psi_g.add_metric([name], f["psi"])
            flag.add_metric([name], float(f["drift"]))
            if "ks_statistic" in f:
                ks_g.add_metric([name], f["ks_statistic"])
        yield from (psi_g, ks_g, flag)
        yield GaugeMetricFamily("lmserve:drift_window_samples", "Requests in the drift window",
                                value=report["window"]["samples"])
        yield GaugeMetricFamily("lmserve:drift_threshold", "PSI threshold for drift", value=self.monitor.threshold)


# -- `lmserve monitor profile` --------------------------------------------------------------------


def profile_command(payload_path: str, out: TextIO) -> int:
    """Write a reference profile built from a payload log to `out`; skips partial lines and failed requests."""
    good, skipped = [], 0
    try:
        with open(payload_path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    skipped += 1
                    continue
                if isinstance(rec, dict) and rec.get("status") == 200:
                    good.append(rec)
                else:
                    skipped += 1
    except OSError as e:
        print(f"lmserve monitor profile: cannot read {payload_path}: {e.strerror}", file=sys.stderr)
        return 2
    if not good:
        print(f"lmserve monitor profile: no successful requests in {payload_path}", file=sys.stderr)
        return 1
    json.dump(build_profile(good, source=str(payload_path)), out)
    out.write("\n")
    print(f"profiled {len(good)} requests from {payload_path} ({skipped} lines skipped)", file=sys.stderr)
    return 0
