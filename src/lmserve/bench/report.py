"""Human-readable tables for `lmserve bench latency | throughput`, and the note on a busy machine."""

from __future__ import annotations

import math
import os
import time
from typing import NamedTuple


class Column(NamedTuple):
    """One table column: the row's key, its header, and a format for its values."""

    key: str
    header: str
    fmt: str = "{:.1f}"


LATENCY_COLUMNS = [
    Column("batch_size", "batch", "{}"), Column("input_len", "input tokens", "{}"),
    Column("output_len", "output tokens", "{}"), Column("ttft_ms", "TTFT ms"), Column("tpot_ms", "TPOT ms"),
    Column("prefill_tok_s", "prefill tok/s"), Column("decode_tok_s", "decode tok/s"),
    Column("decode_ceiling_tok_s", "decode ceiling tok/s"), Column("pct_of_decode_ceiling", "% of ceiling", "{:.0f}"),
]
LATENCY_LEGEND = ("TTFT: time until every sequence of the batch has its first token (best run). TPOT: one decode "
                  "step, a token for each sequence (median). ceiling: the batch reading every weight once per step "
                  "at this machine's bandwidth, at most its matmul throughput.")

THROUGHPUT_COLUMNS = [
    Column("batch_size", "max batch", "{}"), Column("num_prompts", "prompts", "{}"),
    Column("input_len", "input tokens", "{}"), Column("output_len", "output tokens", "{}"),
    Column("seconds", "seconds"), Column("output_tok_s", "output tok/s"), Column("total_tok_s", "total tok/s"),
    Column("pct_of_compute_ceiling", "% of compute ceiling", "{:.0f}"),
]
THROUGHPUT_LEGEND = ("max batch: most sequences in one step (--batch-sizes, else --max-num-seqs). total tok/s counts "
                     "prompt and output tokens; the compute ceiling is this machine's matmul throughput.")


def format_table(rows: list[dict], columns: list[Column]) -> str:
    """Right-aligned columns under their headers; a missing or NaN value prints as '-'."""
    cells = [[_cell(row.get(c.key), c.fmt) for c in columns] for row in rows]
    widths = [max([len(c.header)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.header.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


class CpuSample(NamedTuple):
    """Seconds at one moment: wall clock, CPU time busy on the whole machine, and this process's CPU time."""

    wall: float
    machine_busy: float
    own: float


def cpu_sample() -> CpuSample:
    """Read /proc/stat (all cores) and this process's CPU time; zeros for the machine where it is missing."""
    times = os.times()
    try:
        ticks = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        busy = 0.0
    return CpuSample(time.monotonic(), busy, times.user + times.system)


def others_load(start: CpuSample, end: CpuSample) -> dict:
    """Cores other processes kept busy on average between two samples (this process's own CPU excluded)."""
    wall = max(end.wall - start.wall, 1e-9)
    others = max(0.0, (end.machine_busy - start.machine_busy) - (end.own - start.own)) / wall
    return {"other_processes_cores": others, "cores": len(os.sched_getaffinity(0)),
            "loadavg_1m_at_end": os.getloadavg()[0]}


def load_note(load: dict) -> str | None:
    """A warning when other work shared the CPU: then a busy neighbour, not the engine, sets the numbers."""
    if load["other_processes_cores"] < 0.2:
        return None
    return (f"note: other processes kept {load['other_processes_cores']:.1f} of {load['cores']} cores busy on "
            f"average during this run: expect slower, noisier numbers than on an idle machine.")
