"""Where a kernel's warps stall, by region of its machine code, from Nsight Compute's source page.

Reads the CSV that `ncu -i REPORT --page source --csv --print-source sass` writes for a report
taken with the SourceCounters section (warp-state samples per SASS instruction), splits the kernel
at its largest loop (the backward branch that jumps furthest) into prologue, loop and epilogue,
and prints for each region its share of the samples, its executed warp instructions and its
leading stall reasons, then the loop's instructions by opcode (count in the loop, samples on them)
and the sampled lines of the epilogue. No GPU needed; the report is taken on the GPU's machine:

    ncu -k regex:partial --launch-skip 1 --launch-count 1 --section SourceCounters \\
        --section WarpStateStats -o p16k8 python -m benchmarks.q4sdpa_ncu --run --contexts 16384 --rows 8
    ncu -i p16k8.ncu-rep --page source --csv --print-source sass > p16k8-sass.csv
    python -m benchmarks.sass_stalls p16k8-sass.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path: str) -> list[dict]:
    """The SASS lines of the CSV at `path` (its first kernel), each a dict by column name."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[at]
    lines = []
    for r in rows[at + 1:]:
        if len(r) != len(header) or r[0] == "Address":
            break  # the next kernel's table
        lines.append(dict(zip(header, r)))
    return lines


def opcode(line: dict) -> str:
    """The line's opcode without its predicate and modifiers (`@!P0 HFMA2.MMA ...` -> HFMA2)."""
    text = line["Source"].strip()
    if text.startswith("@"):
        text = text.split(None, 1)[1]
    return text.split()[0].split(".")[0]


def main_loop(lines: list[dict]) -> tuple[int, int]:
    """(first, past last) line index of the loop whose backward branch jumps furthest back."""
    where = {int(l["Address"], 16): i for i, l in enumerate(lines)}
    best = (0, 0)
    for i, l in enumerate(lines):
        if opcode(l) != "BRA":
            continue
        try:
            target = int(l["Source"].split()[-1].rstrip(";"), 16)
        except ValueError:
            continue
        j = where.get(target)
        if j is not None and j < i and i - j > best[1] - best[0]:
            best = (j, i + 1)
    return best


def stalls(lines: list[dict]) -> list[tuple[int, str]]:
    """Samples by stall reason over `lines` (issued and not), most first."""
    keys = [k for k in (lines[0] if lines else {}) if k.startswith("stall_") and "Not Issued" not in k]
    totals = {k[len("stall_"):]: sum(int(l[k] or 0) for l in lines) for k in keys}
    return sorted(((v, k) for k, v in totals.items() if v), reverse=True)


def report(path: str, top: int = 7) -> str:
    """The text this module prints for one CSV."""
    lines = read(path)
    first, past = main_loop(lines)
    total = sum(int(l[SAMPLES]) for l in lines) or 1
    out = [f"{path}: {len(lines)} SASS lines, {total} samples, loop lines {first}-{past - 1}"]
    for name, part in (("prologue", lines[:first]), ("loop", lines[first:past]), ("epilogue", lines[past:])):
        samples = sum(int(l[SAMPLES]) for l in part)
        executed = sum(int(l[EXECUTED]) for l in part)
        lead = ", ".join(f"{k} {v}" for v, k in stalls(part)[:top])
        out.append(f"  {name:9s} {samples:6d} samples ({100 * samples / total:4.1f}%), {executed:10d} warp "
                   f"instructions" + (f"; {lead}" if lead else ""))
    count, sampled = collections.Counter(), collections.Counter()
    for l in lines[first:past]:
        count[opcode(l)] += 1
        sampled[opcode(l)] += int(l[SAMPLES])
    out.append("  loop by opcode (lines, samples): " + ", ".join(f"{k} {v}/{sampled[k]}" for k, v in count.most_common(20)))
    hot = sorted((l for l in lines[past:] if int(l[SAMPLES])), key=lambda l: -int(l[SAMPLES]))[:top]
    out.append("  epilogue's most sampled lines: " + "; ".join(
        f"{l['Source'].strip()[:40]} ({l[SAMPLES]}: {', '.join(f'{k} {v}' for v, k in stalls([l])[:2])})" for l in hot))
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", nargs="+", help="ncu source-page CSV files (--print-source sass)")
    parser.add_argument("--top", type=int, default=7, help="stall reasons and lines to list per region")
    args = parser.parse_args(argv)
    for path in args.csv:
        print(report(path, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
