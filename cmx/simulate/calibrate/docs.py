"""The calibration's section of docs/BENCHMARKS.md, rewritten between its markers."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

from cmx.simulate.calibrate.result import CalibrationResult

__all__ = ["render", "rewrite_section"]

BEGIN = "<!-- cmx-simulate:calibration:begin -->"
END = "<!-- cmx-simulate:calibration:end -->"
GB = 1e9


def render(result: CalibrationResult) -> str:
    s = result.speeds
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        BEGIN,
        "### `simulate --calibrate`",
        "",
        f"Command: `{result.command}`  ",
        f"Machine: {platform.processor() or platform.machine()}, {platform.node()}  ",
        f"Run: {when}" + (f", code {result.code}" if result.code else ""),
        "",
        "This machine's speeds, without the service (the median of the measurements made "
        "at the start of each repetition; each repetition's prediction uses its own):",
        "",
        "| move | GB/s |",
        "| --- | --- |",
        f"| copy between arenas (`copy_bytes`; NIXL's stand-in where NIXL cannot run) | "
        f"{s.copy / GB:.2f} |",
        f"| blocks into a new tensor, each checked as copied (`copy_payloads`, on a thread) | "
        f"{s.copy_out / GB:.2f} |",
        f"| the same, each thread's, with a thread on every core | {s.copy_out_at(2) / GB:.2f} |",
        f"| O_DIRECT read, 4 MiB x 8 in flight | {s.odirect_read / GB:.2f} |",
        f"| XXH3 checksum | {s.checksum / GB:.2f} |",
        f"| NIXL read between processes ({s.nixl_note}) | {s.nixl / GB:.2f} |",
        "",
        *_latency(result),
        "Control path per load (Ray round trips, actor hops, pins, the directory), from the "
        "loads of 1 and of 8 tiny blocks through the client (median over the repetitions):",
        "",
        "| source | fixed ms | per block ms |",
        "| --- | --- | --- |",
        *(f"| {k} | {v.fixed_s * 1e3:.2f} | {v.per_block_s * 1e3:.2f} |"
          for k, v in result.control.items()),
        "",
        f"The service's loads (`NamespaceClient.load`), N clients at once (one client: "
        f"loads one after another), against the "
        f"simulator's prediction of the same N loads (goal: within {result.goal:.0%}): the median "
        "of every load of every repetition on both sides. Beside them, not judged and never "
        "in the prediction's place, the CPU floor: N times one load's own CPU-seconds "
        "(measured with one client) over the cores, the median over the repetitions "
        "(`predict.cpu_floor`):",
        "",
        # "result" last: the page's summary counts the tables whose last column it is
        "| source | clients | bytes per load | loads | measured s (median) | predicted s (median) "
        "| CPU floor s (median) | error | result |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {r.source} | {r.clients} | {r.nbytes >> 20} MiB | {len(r.measured_s)} | "
          f"{r.measured:.3f} | {r.predicted:.3f} | "
          f"{'not measured' if r.floor is None else f'{r.floor:.3f}'} | "
          f"{100 * r.error:+.1f}% | {'**PASS**' if r.ok else '**MISS**'} |"
          for r in result.rows),
        "",
        *_parameters(result),
        *(f"- {n}" for n in result.notes),
        END,
    ]
    return "\n".join(lines)


def _latency(result: CalibrationResult) -> list[str]:
    latency = result.speeds.odirect_latency_s
    if latency is None:
        return []
    return [f"One 4 KiB O_DIRECT read at a time, at random offsets of the same file: "
            f"{latency * 1e6:.0f} µs (median).", ""]


def _parameters(result: CalibrationResult) -> list[str]:
    """The cluster scenarios' parameters against this machine (``parameters``)."""
    if not result.parameters:
        return []
    return [
        "The cluster scenarios' parameters against this machine: each value the scenarios of "
        "`cmx simulate` take (read from the simulator's objects; its kind as the table of "
        "inputs in [SIMULATE](SIMULATE.md) gives it), the value measured in this run (the "
        "median over the repetitions, the least and the most in brackets) and their ratio "
        "(`cmx.simulate.calibrate.parameters`):",
        "",
        "| parameter | the scenarios' value | kind | measured here | kind "
        "| measured / scenarios' | how measured, or why not |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {p.name} | {p.scenarios_text()} (`{p.origin}`) | {p.kind.value} | "
          f"{p.measured_text()} | {p.measured_kind.value if p.measured_kind else ''} | "
          f"{p.ratio_text()} | {p.how} |"
          for p in result.parameters),
        "",
    ]


def rewrite_section(path: Path, result: CalibrationResult) -> None:
    """Replace the section between the markers, or append it if the page has none."""
    text = path.read_text() if path.exists() else ""
    section = render(result)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + section + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
