#!/usr/bin/env python3
"""Lines up nixlbench tables from our nixlbench and from nixl_peer_bench.py (NIXL's own
wheel) and prints, per (op, initiator memory, target memory, block size), the median
bandwidth of each and the median over rounds of the per-round ratio ours/NIXL.

    summarize.py --out DIR ours.1.log nixl.1.log ours.2.log nixl.2.log ...

A log's name says whose it is and its round: `<ours|nixl>.<round>.log`. Writes
DIR/rows.csv (every row of every run) and DIR/ratios.csv (the table printed).
"""

import argparse
import csv
import os
import re
import statistics
import sys

HEADER = re.compile(
    r"^(nixlbench|nixl-peer): .*?backend (\S+).*?, (Write|Read), "
    r"(DRAM|VRAM)(?: \(GPU \d+\))? -> (DRAM|VRAM)")
ROW_FIELDS = ["block_size", "batch_size", "gbps", "avg_lat_us", "avg_prep_us", "p99_prep_us",
              "avg_post_us", "p99_post_us", "avg_tx_us", "p99_tx_us"]


def parse(path):
    """Rows of every table in one log, each tagged with its header's case."""
    rows, case = [], None
    with open(path, errors="replace") as f:
        for line in f:
            m = HEADER.match(line)
            if m:
                case = {"backend": m.group(2), "op": m.group(3).upper(),
                        "initiator_seg": m.group(4), "target_seg": m.group(5)}
                continue
            parts = line.split()
            if case and len(parts) == 10 and parts[0].isdigit():
                try:
                    values = [int(parts[0]), int(parts[1])] + [float(p) for p in parts[2:]]
                except ValueError:
                    continue
                rows.append({**case, **dict(zip(ROW_FIELDS, values))})
    return rows


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("logs", nargs="+")
    o = p.parse_args(argv)
    all_rows = []
    for path in o.logs:
        m = re.match(r"(ours|nixl)\.(\d+)\.log$", os.path.basename(path))
        if not m:
            sys.exit(f"summarize: {path}: expected <ours|nixl>.<round>.log")
        for r in parse(path):
            r.update(impl=m.group(1), round=int(m.group(2)))
            all_rows.append(r)
    os.makedirs(o.out, exist_ok=True)
    with open(os.path.join(o.out, "rows.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["impl", "round", "backend", "op", "initiator_seg",
                                          "target_seg"] + ROW_FIELDS)
        w.writeheader()
        w.writerows(all_rows)

    # (op, iseg, tseg, block) -> impl -> round -> row
    table = {}
    for r in all_rows:
        key = (r["op"], r["initiator_seg"], r["target_seg"], r["block_size"])
        table.setdefault(key, {}).setdefault(r["impl"], {})[r["round"]] = r
    cases = sorted({k[:3] for k in table}, key=lambda c: (c[0] != "WRITE", c[1], c[2]))
    out_rows = []
    for case in cases:
        keys = sorted(k for k in table if k[:3] == case)
        impls = {i for k in keys for i in table[k]}
        backends = {i: sorted({r["backend"] for k in keys for r in table[k].get(i, {}).values()})
                    for i in ("ours", "nixl")}
        print(f"\n{case[0]} {case[1]} -> {case[2]}: ours {'/'.join(backends['ours']) or '-'}"
              f" vs NIXL {'/'.join(backends['nixl']) or '-'}")
        if impls != {"ours", "nixl"}:
            missing = "ours" if "ours" not in impls else "NIXL"
            print(f"  no {missing} result for this case (see compare.log)")
        print(f"  {'Block Size (B)':>14} {'NIXL GB/s':>10} {'ours GB/s':>10} {'ours/NIXL':>10}"
              f" {'range':>13} {'NIXL lat us':>12} {'ours lat us':>12} {'rounds':>6}")
        for key in keys:
            by = table[key]
            nixl, ours = by.get("nixl", {}), by.get("ours", {})
            med = lambda rows, f: statistics.median(r[f] for r in rows.values()) if rows else None
            paired = [ours[r]["gbps"] / nixl[r]["gbps"] for r in sorted(set(ours) & set(nixl))
                      if nixl[r]["gbps"] > 0]
            row = {
                "op": key[0], "initiator_seg": key[1], "target_seg": key[2],
                "block_size": key[3],
                "nixl_backend": "/".join(backends["nixl"]),
                "ours_backend": "/".join(backends["ours"]),
                "nixl_gbps": med(nixl, "gbps"), "ours_gbps": med(ours, "gbps"),
                "ratio_median": statistics.median(paired) if paired else None,
                "ratio_min": min(paired) if paired else None,
                "ratio_max": max(paired) if paired else None,
                "nixl_avg_lat_us": med(nixl, "avg_lat_us"),
                "ours_avg_lat_us": med(ours, "avg_lat_us"),
                "rounds": len(paired),
            }
            out_rows.append(row)
            fmt = lambda v, spec: format(v, spec) if v is not None else "-"
            rng = (f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}" if paired else "-")
            print(f"  {key[3]:>14} {fmt(row['nixl_gbps'], '10.3f'):>10} "
                  f"{fmt(row['ours_gbps'], '10.3f'):>10} {fmt(row['ratio_median'], '10.2f'):>10}"
                  f" {rng:>13} {fmt(row['nixl_avg_lat_us'], '12.2f'):>12}"
                  f" {fmt(row['ours_avg_lat_us'], '12.2f'):>12} {row['rounds']:>6}")
    with open(os.path.join(o.out, "ratios.csv"), "w", newline="") as f:
        fields = ["op", "initiator_seg", "target_seg", "block_size", "nixl_backend",
                  "ours_backend", "nixl_gbps", "ours_gbps", "ratio_median", "ratio_min",
                  "ratio_max", "nixl_avg_lat_us", "ours_avg_lat_us", "rounds"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(out_rows)
    if not all_rows:
        print("summarize: no result rows in any log", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
