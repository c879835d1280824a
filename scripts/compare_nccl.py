#!/usr/bin/env python3
"""Summarises `oxccl bench COLL --gpus N --json` logs against `scripts/nccl_bench.py --json` logs: the
mean busbw over the sizes at or above --from (default 64 MiB) per collective and CTA count, oxccl out of
place and in place, NCCL with NCCL_MAX_CTAS at the same value and at its default, and the ratios, as a
Markdown table. Reads only the JSON lines; everything else in the logs is ignored.

    python3 scripts/compare_nccl.py --oxccl multi_bench.log --nccl nccl_bench.log
"""

import argparse
import json
import sys


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper()
    return int(s[:-1]) * units[s[-1]] if s and s[-1] in units else int(s)


def json_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows


def mean(values):
    # `null`: a side that did not run (a compiled plan's row runs one side).
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def fmt(x):
    return "–" if x is None else f"{x:.1f}"


def ratio(a, b):
    return "–" if a is None or not b else f"{a / b:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--oxccl", required=True, nargs="+", help="logs of oxccl bench --json")
    p.add_argument("--nccl", required=True, nargs="+", help="logs of scripts/nccl_bench.py --json")
    p.add_argument("--from", dest="min_size", type=parse_size, default=64 << 20,
                   help="smallest size averaged (default 64M)")
    args = p.parse_args()

    ox = [r for path in args.oxccl for r in json_rows(path) if "oop_busbw" in r]
    nc = [r for path in args.nccl for r in json_rows(path) if r.get("library") == "nccl"]
    if not ox or not nc:
        sys.exit(f"no rows: {len(ox)} oxccl, {len(nc)} NCCL (were the runs made with --json?)")
    ranks = sorted({r["ranks"] for r in ox} | {r["ranks"] for r in nc})
    if len(ranks) != 1:
        sys.exit(f"the logs mix rank counts {ranks}: compare one machine at a time")
    # oxccl's rows give the bytes a call moves: a size the rank count does not divide falls short of
    # the sweep's size by less than one 16-byte element block per rank.
    big = args.min_size - 16 * ranks[0]

    print(f"Mean busbw (GB/s) over sizes >= {args.min_size} B, {ranks[0]} ranks.\n")
    print("| collective | CTAs per rank | oxccl out of place | oxccl in place | NCCL same CTAs | NCCL default "
          "| oxccl / NCCL same | oxccl / NCCL default |")
    print("|---|---|---|---|---|---|---|---|")
    for coll in ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]:
        nccl_default = mean(r["busbw"] for r in nc
                            if r["collective"] == coll and r["nccl_max_ctas"] == "default" and r["size"] >= big)
        for ctas in sorted({r["ctas"] for r in ox if r["collective"] == coll}):
            sel = [r for r in ox if r["collective"] == coll and r["ctas"] == ctas and r["size"] >= big]
            oop = mean(r["oop_busbw"] for r in sel)
            ip = mean(r["ip_busbw"] for r in sel)
            same = mean(r["busbw"] for r in nc
                        if r["collective"] == coll and r["nccl_max_ctas"] == str(ctas) and r["size"] >= big)
            print(f"| {coll} | {ctas} | {fmt(oop)} | {fmt(ip)} | {fmt(same)} | {fmt(nccl_default)} "
                  f"| {ratio(oop, same)} | {ratio(oop, nccl_default)} |")
    # `null`: not checked (older logs wrote 2**64 - 1 for that).
    unchecked = (0, None, 2**64 - 1)
    wrong = [r for r in ox if r["oop_wrong"] not in unchecked or r["ip_wrong"] not in unchecked]
    wrong += [r for r in nc if r.get("wrong_ranks")]
    if wrong:
        print(f"\n{len(wrong)} rows reported wrong results: the bandwidths above do not count.")
        sys.exit(1)


if __name__ == "__main__":
    main()
