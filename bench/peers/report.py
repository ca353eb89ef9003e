"""The report: every sample as CSV, medians and spread as JSON, Markdown tables and matplotlib
plots (bandwidth and latency against message size, one line per engine, ceilings dashed).

  python report.py RESULTS_DIR [--md FILE --img DIR]   redraw from RESULTS_DIR/samples.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
from collections import defaultdict

from causes import cause_for  # beside this file: its folder is on sys.path (a script's, or the tests')

SECTIONS = {"tcp": "Loopback TCP", "shm": "Same host (shared memory, CMA)", "rdma": "Inside the SoftRoCE guest (RDMA)"}
OPS = ("read", "write", "send")


def size_text(b: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if b >= (1 << shift) and b % (1 << shift) == 0:
            return f"{b >> shift} {unit}"
    return f"{b} B"


def num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def aggregate(samples: list[dict]) -> dict:
    """(section, engine, op, size, batch, conc) -> medians and spread over the rounds."""
    groups: dict = defaultdict(list)
    for d in samples:
        groups[(d["section"], d["engine"], d["op"], d["size"], d["batch"], d["conc"])].append(d)
    out = {}
    for k, ds in groups.items():
        ok = [d for d in ds if not d["error"] and d.get("mbps")]
        bw = [d["mbps"] for d in ok]
        lat = [d["lat_ms"] for d in ok if d.get("lat_ms") is not None]
        out[k] = {
            "rounds": len(ds), "ok": len(ok), "ceiling": ds[0].get("ceiling", False),
            "mbps": statistics.median(bw) if bw else None, "mbps_min": min(bw) if bw else None,
            "mbps_max": max(bw) if bw else None,
            "lat_us": statistics.median(lat) * 1e3 if lat else None,
            "lat_us_min": min(lat) * 1e3 if lat else None, "lat_us_max": max(lat) * 1e3 if lat else None,
            "checked": all(d["checked"] is not False for d in ds) and any(d["checked"] for d in ds),
            "error": next((d["error"] for d in ds if d["error"]), ""),
        }
    return out


def ceiling_for(engine: str, names: list[str]) -> str | None:
    """The ceiling matched to a Sluice engine: TCP streams for tcp, process_vm_readv for shm on
    the caller's memory (CMA), memcpy for shm on engine-allocated memfd memory, perftest for rdma."""
    want = "memcpy" if "memfd" in engine else "process_vm_readv" if "shm" in engine else \
        "perftest" if "rdma" in engine else "tcp streams"
    return next((n for n in names if n.startswith("ceiling") and want in n), None)


def write_csv(path: str, samples: list[dict]) -> None:
    cols = ["engine", "section", "version", "settings", "env", "round", "op", "size", "batch", "conc", "iters",
            "secs", "mbps", "lat_ms", "checked", "error"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for d in samples:
            w.writerow([json.dumps(d.get(c)) if isinstance(d.get(c), dict) else d.get(c, "") for c in cols])


def cell_text(a: dict | None, what: str = "mbps") -> str:
    if a is None:
        return "—"
    if a[what] is None:
        if a["error"].startswith("TimeoutError"):
            return "failed: timeout"
        return "failed" if a["error"] else "—"
    lo, hi = a[f"{what}_min"], a[f"{what}_max"]
    star = "" if a["checked"] or a["ceiling"] else " ✗"
    return f"{num(a[what])} [{num(lo)}–{num(hi)}]{star}" if a["ok"] > 1 else f"{num(a[what])}{star}"


def hugepages_text(meta: dict) -> str:
    if "hugepages" not in meta:  # runs before 2026-11-29: numpy's buffers had them, the native ones not
        return ""
    return f", {'with' if meta['hugepages'] else 'without'} transparent huge pages asked for every engine's buffers " \
           f"(`PEERS_HUGEPAGES`)"


def markdown(meta: dict, agg: dict, img_prefix: str | None) -> str:
    L = []
    L.append(f"Measured {meta['date']} on `{meta['host']}` ({meta['cpus']} CPUs; load average before the run "
             f"{', '.join(f'{x:.1f}' for x in meta['load_before'])}), {meta['rounds']} interleaved round(s)"
             f"{' (--quick)' if meta['quick'] else ''}, {meta['wall_s']} s. Cells: median MB/s (10^6 B/s) "
             f"[min–max over the rounds]; ✗ = the byte check failed; footprint {meta['footprint'] >> 20} MiB per "
             f"side{hugepages_text(meta)}; Sluice with {meta['channels']} channels, ceilings with as many streams/threads (one at a "
             f"time for batch 1, concurrency 1).")
    L.append("")
    L.append("Versions: " + ", ".join(f"{k.replace('_peer', '')} {v}" for k, v in meta["versions"].items()) + ".")
    L.append("")
    engines_by_section: dict = defaultdict(list)
    for e in meta["engines"]:
        engines_by_section[e["section"]].append(e)
    for section, title in SECTIONS.items():
        es = engines_by_section.get(section, [])
        if not es:
            continue
        L.append(f"### {title}")
        L.append("")
        if section in {e["section"] for e in meta["engines"]} and all(n in meta["not_run"] for n in
                                                                       [e["name"] for e in es]):
            for e in es:
                L.append(f"- {e['name']}: {meta['not_run'][e['name']]}")
            L.append("")
            continue
        if section == "rdma" and meta.get("rdma"):
            r = meta["rdma"]
            took = f" ({r['wall_s']} s, boot included)" if r.get("wall_s") else ""
            L.append(f"One SoftRoCE guest (QEMU under TCG, `tests/rdma/rxe-guest.sh`: rxe0 on a dummy netdev, "
                     f"loopback RC queue pairs, RoCE v2 GID), booted once by this run"
                     f"{took}: every engine with {r['qps']} QP per connection, the same rounds interleaved; "
                     f"footprint {r['footprint'] >> 20} MiB per side, {r['budget'] >> 20} MiB per cell; at most "
                     f"{r['engine_timeout_s']:.0f} s per engine and round and {r['guest_budget_s']:.0f} s for the "
                     f"guest. Emulated: only ratios within this section mean anything; the ceiling is perftest "
                     f"on the same device.")
            L.append("")
            for e in es:
                if e["name"] in meta["not_run"]:
                    L.append(f"- {e['name']}: {meta['not_run'][e['name']]}")
            if any(e["name"] in meta["not_run"] for e in es):
                L.append("")
        names = [e["name"] for e in es if e["name"] not in meta["not_run"]]
        for op in OPS:
            cols = [n for n in names if any(k[1] == n and k[2] == op for k in agg)]
            if not cols:
                continue
            sluices = [n for n in cols if n.startswith("sluice")]
            peers = [n for n in cols if not n.startswith("sluice") and not n.startswith("ceiling")]
            shapes = sorted({(k[3], k[4], k[5]) for k in agg if k[0] == section and k[2] == op})
            L.append(f"#### {op.upper()}: bandwidth, MB/s")
            L.append("")
            hdr = ["size", "batch", "conc"] + cols
            if peers and sluices:
                hdr.append("best sluice ÷ best peer")
            hdr += [f"{s} ÷ ceiling" for s in sluices if ceiling_for(s, cols)]
            L.append("| " + " | ".join(hdr) + " |")
            L.append("|" + "---|" * len(hdr))
            for size, batch, conc in shapes:
                row = [size_text(size), str(batch), str(conc)]
                a = {n: agg.get((section, n, op, size, batch, conc)) for n in cols}
                row += [cell_text(a[n]) for n in cols]
                bs = max((a[n]["mbps"] for n in sluices if a[n] and a[n]["mbps"]), default=None)
                bp_name = max((n for n in peers if a[n] and a[n]["mbps"]), key=lambda n: a[n]["mbps"], default=None)
                if peers and sluices:
                    row.append(f"{bs / a[bp_name]['mbps']:.2f} ({bp_name})" if bs and bp_name else "—")
                for s in sluices:
                    c = ceiling_for(s, cols)
                    if c:
                        ok = a[s] and a[s]["mbps"] and a[c] and a[c]["mbps"]
                        row.append(f"{a[s]['mbps'] / a[c]['mbps']:.2f}" if ok else "—")
                L.append("| " + " | ".join(row) + " |")
            L.append("")
            lat_cols = [n for n in cols if agg.get((section, n, op, shapes[0][0], 1, 1))]
            if lat_cols:
                L.append(f"#### {op.upper()}: latency of one operation (batch 1, concurrency 1), µs")
                L.append("")
                L.append("| size | " + " | ".join(lat_cols) + " |")
                L.append("|" + "---|" * (len(lat_cols) + 1))
                for size in sorted({s for s, b, c in shapes if b == 1 and c == 1}):
                    row = [size_text(size)] + [cell_text(agg.get((section, n, op, size, 1, 1)), "lat_us")
                                               for n in lat_cols]
                    L.append("| " + " | ".join(row) + " |")
                L.append("")
            if img_prefix is not None and has_plot(agg, section, op):
                L.append(f"![{section} {op}]({img_prefix}peers-{section}-{op}.png)")
                L.append("")
        errs = sorted({(k[1], a["error"]) for k, a in agg.items() if k[0] == section and a["error"]})
        if errs:
            L.append("Rows without numbers, and why:")
            L.append("")
            seen = set()
            for name, err in errs:
                line = f"- {name}: {err.splitlines()[0][:300]}"
                if line not in seen:
                    seen.add(line)
                    L.append(line)
            L.append("")
    L += ["### Where Sluice loses a cell or misses a bar", "", verdict_markdown(meta, agg)]
    return "\n".join(L)


# The bars: Sluice tcp >= 0.9x its matched TCP ceiling, shm >= 0.8x its matched
# process_vm_readv / memcpy ceiling, at >= 1 MiB; a lone operation (batch 1, conc 1) >= 0.8x.
CEILING_BAR = {"tcp": 0.9, "shm": 0.8, "rdma": 0.8}
LONE_BAR = 0.8


def verdicts(meta: dict, agg: dict) -> tuple[list, list]:
    """(peer losses, ceiling misses): every cell where the best Sluice engine is below the best
    peer, and every Sluice cell at >= 1 MiB below its ceiling bar. Sorted worst first."""
    losses, misses = [], []
    names = {e["name"]: e for e in meta["engines"] if e["name"] not in meta["not_run"]}
    cells = sorted({(k[0], k[2], k[3], k[4], k[5]) for k in agg})
    for section, op, size, batch, conc in cells:
        a = {n: agg.get((section, n, op, size, batch, conc)) for n in names}
        a = {n: v for n, v in a.items() if v and v["mbps"]}
        sl = {n: v["mbps"] for n, v in a.items() if n.startswith("sluice")}
        peers = {n: v["mbps"] for n, v in a.items() if not n.startswith(("sluice", "ceiling"))}
        if sl and peers:
            bs, bp = max(sl, key=sl.get), max(peers, key=peers.get)
            if sl[bs] < peers[bp]:
                losses.append({"section": section, "op": op, "size": size, "batch": batch, "conc": conc,
                               "sluice": bs, "sluice_mbps": sl[bs], "peer": bp, "peer_mbps": peers[bp],
                               "ratio": sl[bs] / peers[bp]})
        if size < (1 << 20):
            continue
        for s, v in sl.items():
            c = ceiling_for(s, [n for n in a if n.startswith("ceiling")])
            if not c:
                continue
            bar = LONE_BAR if (batch, conc) == (1, 1) else CEILING_BAR.get(section, 0.8)
            r = v / a[c]["mbps"]
            if r < bar:
                misses.append({"section": section, "op": op, "size": size, "batch": batch, "conc": conc,
                               "sluice": s, "ceiling": c, "ratio": r, "bar": bar})
    for d in losses:
        d["cause"] = cause_for("loss", d)
    for d in misses:
        d["cause"] = cause_for("miss", d)
    losses.sort(key=lambda d: d["ratio"])
    misses.sort(key=lambda d: d["ratio"] / d["bar"])
    return losses, misses


def cause_text(d: dict, doc: str) -> str:
    """The measured cause beside a lost or missed cell (causes.py), linked to its section."""
    c = d["cause"]
    return f"{c.text} ([measured]({doc}#{c.anchor}))" if c else "**not explained**"


def explained(rows: list[dict]) -> str:
    n = sum(1 for d in rows if d["cause"])
    return f"{n} of {len(rows)} with a measured cause named (causes.py)"


def verdict_markdown(meta: dict, agg: dict, doc: str = "") -> str:
    """Where Sluice loses to a peer or misses a ceiling bar, by how much, and what was measured
    about it; `doc` is how the Markdown names docs/peers.md (empty: it is that file)."""
    losses, misses = verdicts(meta, agg)
    compared = {(k[0], k[2], k[3], k[4], k[5]) for k in agg if k[1].startswith("sluice")}
    L = [f"**Sluice against the peers:** {len(compared) - len(losses)} of {len(compared)} cells won or "
         f"tied, {len(losses)} lost (best Sluice engine against the best peer, medians)"
         + (f"; {explained(losses)}." if losses else "."), ""]
    if losses:
        L += ["| section | op | size | batch | conc | best sluice MB/s | best peer MB/s | ratio | measured cause |",
              "|---|---|---|---|---|---|---|---|---|"]
        for d in losses:
            L.append(f"| {d['section']} | {d['op']} | {size_text(d['size'])} | {d['batch']} | {d['conc']} | "
                     f"{num(d['sluice_mbps'])} ({d['sluice']}) | {num(d['peer_mbps'])} ({d['peer']}) | "
                     f"{d['ratio']:.2f} | {cause_text(d, doc)} |")
        L.append("")
    L += [f"**Ceiling bars at ≥ 1 MiB** (tcp ≥ {CEILING_BAR['tcp']}×, shm ≥ {CEILING_BAR['shm']}×, rdma ≥ "
          f"{CEILING_BAR['rdma']}× (perftest) the matched ceiling; a lone operation ≥ {LONE_BAR}× one operation at "
          f"a time): {len(misses)} cell(s) missed" + (f"; {explained(misses)}." if misses else "."), ""]
    if misses:
        L += ["| section | op | size | batch | conc | engine | ÷ ceiling | bar | measured cause |",
              "|---|---|---|---|---|---|---|---|---|"]
        for d in misses:
            L.append(f"| {d['section']} | {d['op']} | {size_text(d['size'])} | {d['batch']} | {d['conc']} | "
                     f"{d['sluice']} | {d['ratio']:.2f} | {d['bar']} | {cause_text(d, doc)} |")
        L.append("")
    return "\n".join(L)


def summary_markdown(meta: dict, agg: dict, img_prefix: str | None, full_doc: str) -> str:
    """The short form for docs/performance.md: the run, the verdicts, the plots."""
    L = [f"Generated by `bench/peers/run.sh` on {meta['date']} ({meta['cpus']} CPUs, load average before the run "
         f"{', '.join(f'{x:.1f}' for x in meta['load_before'])}: a shared, loaded host; compare ratios within the "
         f"run), {meta['rounds']} interleaved round(s), {meta['wall_s']} s. Every table, the settings and the "
         f"rows that could not run: [{full_doc}]({full_doc}).", "", verdict_markdown(meta, agg, full_doc)]
    if img_prefix is not None:
        for section in SECTIONS:
            for op in OPS:
                if has_plot(agg, section, op):
                    L += [f"![{section} {op}]({img_prefix}peers-{section}-{op}.png)", ""]
    return "\n".join(L)


def has_plot(agg: dict, section: str, op: str) -> bool:
    return any(a["mbps"] for k, a in agg.items() if k[0] == section and k[2] == op)


def plots(agg: dict, meta: dict, img_dir: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"report: no plots: matplotlib cannot be imported ({e})", file=sys.stderr)
        return []
    os.makedirs(img_dir, exist_ok=True)
    out = []
    for section in SECTIONS:
        for op in OPS:
            keys = [k for k in agg if k[0] == section and k[2] == op]
            if not has_plot(agg, section, op):  # no numbers (every row failed or not run)
                continue
            shapes = sorted({(k[4], k[5]) for k in keys})
            panels = [("bw", b, c) for b, c in shapes] + [("lat", 1, 1)]
            fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
            for ax, (kind, b, c) in zip(axes[0], panels):
                for name in sorted({k[1] for k in keys}):
                    pts = sorted((k[3], agg[k]) for k in keys if k[1] == name and k[4] == b and k[5] == c)
                    what = "mbps" if kind == "bw" else "lat_us"
                    pts = [(s, a) for s, a in pts if a[what]]
                    if not pts:
                        continue
                    xs = [s for s, _ in pts]
                    ys = [a[what] / (1e3 if kind == "bw" else 1) for _, a in pts]
                    ceiling = name.startswith("ceiling")
                    ax.plot(xs, ys, linestyle="--" if ceiling else "-", marker="" if ceiling else "o",
                            color="black" if ceiling and "memcpy" not in name else None, linewidth=2 if
                            name.startswith("sluice") else 1, label=name)
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xlabel("message size (bytes)")
                ax.set_ylabel("GB/s" if kind == "bw" else "µs per operation")
                ax.set_title(f"{op.upper()} {'bandwidth' if kind == 'bw' else 'latency'}, batch {b}, conc {c}")
                ax.grid(True, which="both", alpha=0.3)
            axes[0][0].legend(fontsize=7)
            fig.suptitle(f"{SECTIONS[section]}: {op.upper()} ({meta['date']}, {meta['rounds']} round(s))")
            fig.tight_layout()
            path = os.path.join(img_dir, f"peers-{section}-{op}.png")
            fig.savefig(path, dpi=80)
            plt.close(fig)
            out.append(path)
    return out


def write_all(out_dir: str, meta: dict, samples: list[dict], md_path: str | None = None,
              img_dir: str | None = None, img_prefix: str | None = None, summary_path: str | None = None) -> None:
    agg = aggregate(samples)
    write_csv(os.path.join(out_dir, "samples.csv"), samples)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"meta": meta, "cells": [dict(zip(("section", "engine", "op", "size", "batch", "conc"), k), **v)
                                           for k, v in sorted(agg.items())]}, f, indent=1)
    img_dir = img_dir or out_dir
    md_path = md_path or os.path.join(out_dir, "peers.md")
    pngs = plots(agg, meta, img_dir)
    prefix = None
    if pngs:
        prefix = img_prefix if img_prefix is not None else \
            os.path.relpath(img_dir, os.path.dirname(os.path.abspath(md_path))) + "/"
    with open(md_path, "w") as f:
        f.write(markdown(meta, agg, prefix) + "\n")
    if summary_path:  # for docs/performance.md, beside docs/peers.md
        with open(summary_path, "w") as f:
            f.write(summary_markdown(meta, agg, prefix, "peers.md") + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--md", default=None, help="write the Markdown here (default RESULTS/peers.md)")
    p.add_argument("--img", default=None, help="write the PNGs here (default RESULTS)")
    p.add_argument("--img-prefix", default=None, help="how the Markdown names the PNGs' folder")
    p.add_argument("--summary", default=None, help="also write the short form (verdicts, plots) here")
    o = p.parse_args(argv)
    with open(os.path.join(o.results, "samples.json")) as f:
        d = json.load(f)
    write_all(o.results, d["meta"], d["samples"], o.md, o.img, o.img_prefix, o.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
