"""Where a kernel's warps stall, from ncu's source page: the stall reasons summed over its SASS lines,
then the lines with the most warp stall samples.

    ncu --clock-control none -k regex:KERNEL --launch-count 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv python3 DRIVER.py > src.csv
    python3 tools/ncu_top.py src.csv [--lines 45]
"""
from __future__ import annotations

import argparse
import collections
import csv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--lines", type=int, default=45, help="SASS lines listed")
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv, errors="replace")))
    hi = next(i for i, r in enumerate(rows) if "Source" in (c.strip() for c in r))
    head = [c.strip() for c in rows[hi]]
    src, addr = head.index("Source"), head.index("Address")
    col = next(i for i, c in enumerate(head) if c.startswith("Warp Stall Sampling (All"))
    reasons = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    data = []
    for r in rows[hi + 1:]:
        try:
            data.append((float(r[col].replace(",", "")), r))
        except (ValueError, IndexError):
            continue
    total = sum(v for v, _ in data) or 1.0
    print(f"{len(data)} SASS lines, {total:.0f} warp stall samples")
    agg = collections.Counter()
    for _, r in data:
        for i in reasons:
            try:
                agg[head[i]] += float(r[i].replace(",", ""))
            except ValueError:
                pass
    for name, v in agg.most_common():
        if v:
            print(f"  {name:28s} {v:8.0f}  {v / total * 100:5.1f}%")
    for v, r in sorted(data, key=lambda x: -x[0])[:args.lines]:
        print(f"{v / total * 100:5.1f}% {r[addr]:>16s}  {r[src][:110]}")


if __name__ == "__main__":
    main()
