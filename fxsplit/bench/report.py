"""The benchmark's table on stdout: the six modes' figures, each section's lines and every verdict."""

from __future__ import annotations

from typing import Any

from fxsplit.bench.compile_time import COMPILE_USERS

__all__ = ["format_table"]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _verdict_line(name: str, t: dict[str, Any]) -> str:
    """``target PASS|MISS[ (unreliable)]: what: measured (spread)`` for one target."""
    verdict = t.get("verdict") or ("PASS" if t["pass"] else "MISS")  # results written before spreads were kept
    if name == "duplicated_flops":
        return f"target {verdict}: {t['what']} (measured {t['measured']:.3f} %, exact FLOP counts)"
    if verdict == "n/a":
        return f"target n/a: {t['what']} ({t['unreliable_because']})"
    if "detail" in t:  # exact figures (memory, FLOPs): no spread
        return f"target {verdict}: {t['what']} (measured {t['measured']:.3f}, target {t['target']}; {t['detail']})"
    line = f"target {verdict}: {t['what']} (measured {t['measured']:.3f} x"
    sp = t.get("spread")
    if sp:
        line += (f"; per-repetition ratio over {sp['n']} paired repetitions: median {sp['median']:.3f}, "
                 f"IQR {sp['q25']:.3f}-{sp['q75']:.3f}, min-max {sp['min']:.3f}-{sp['max']:.3f}")
    else:
        line += "; no spread recorded: results written by an older fxsplit bench, reliability unknown"
    line += ")"
    if t.get("unreliable_because"):
        more = "--compile-reps" if name.startswith("compile") else "--reps"
        line += f"\n    unreliable: {t['unreliable_because']}; rerun with more {more} on an idle machine"
    return line


def _section_lines(result: dict[str, Any]) -> list[str]:
    """Host time, accumulation, memory per stage layout and compile time, where the result has them."""
    out: list[str] = []
    host = result.get("host")
    if host is not None:
        if not host["available"]:
            out.append(f"host time (fxsplit split, outside the compiled graphs): {host['why']}")
        else:
            med = lambda k: host[k]["median"]  # noqa: E731
            out.append(
                f"fxsplit split, median ms: B graphs {med('b_graph_ms'):.3f} + host {med('b_host_ms'):.3f}; "
                f"W graphs {med('w_graph_ms'):.3f} + host {med('w_host_ms'):.3f}"
                + (f" (commit {med('w_commit_ms'):.3f})" if "w_commit_ms" in host else "")
                + f"; host B+W {med('host_ms'):.3f} (IQR {host['host_ms']['q25']:.3f}-{host['host_ms']['q75']:.3f})")
            if "added_ms" in host:
                out.append(
                    f"fxsplit ordinary backward, median ms outside its fused graphs: {med('ordinary_host_ms'):.3f}; "
                    f"the split adds {med('added_ms'):.3f} (IQR {host['added_ms']['q25']:.3f}-"
                    f"{host['added_ms']['q75']:.3f})")
    modes = result.get("modes") or []
    if modes and all(r.get("minor_faults_backward") is not None for r in modes):
        out.append("minor page faults per backward (median; memory the allocator maps afresh): " + ", ".join(
            f"{r['key']} {r['minor_faults_backward']:.0f}" for r in modes)
            + (f" [{result['allocator']}]" if result.get("allocator") else ""))
    acc = result.get("accumulate")
    if acc is not None:
        i, f = acc["inductor"], acc["fxsplit+split"]
        out.append(f"{acc['microbatches']} microbatches into .grad, backward ms (median, IQR): inductor "
                   f"{i['median_ms']:.2f} ({i['iqr_ms']:.2f}), fxsplit B+W {f['median_ms']:.2f} ({f['iqr_ms']:.2f}), "
                   f"n={f['n']}")
    mem = result.get("memory")
    if mem and "rows" in mem:
        kib = lambda v: "-" if v is None else f"{v / 1024:.1f}"  # noqa: E731
        out.append(f"memory between B and W (KiB; {mem['microbatches']} microbatches in the ZB-V-like order "
                   f"{mem['zbv_sequence']}; {mem['compiler']}):")
        head = ("stage", "split", "alive B->W", "declared", "live-in", "all-crossing", "live-in B/token", "ZB-V peak")
        rows = [(r["layout"], r["variant"], kib(r["alive_bytes"]), kib(r["declared_bytes"]), kib(r["live_in_bytes"]),
                 kib(r["all_crossing_bytes"]),
                 "-" if r["live_in_bytes_per_token"] is None else f"{r['live_in_bytes_per_token']:.0f}",
                 kib(r["zbv_peak_bytes"])) for r in mem["rows"]]
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for cells in (head, *rows):
            out.append("  " + "  ".join(c.ljust(w) if k < 2 else c.rjust(w)
                                        for k, (c, w) in enumerate(zip(cells, widths))))
        fl = mem["flops"]
        out.append(f"  FLOPs (compiler='eager' twins): first stage B {fl['first']['B']:,} W {fl['first']['W']:,}; "
                   f"middle stage B {fl['middle']['B']:,} W {fl['middle']['W']:,}")
        out.append(f"  fxsplit row: {mem['variants']['fxsplit']}")
        for variant, why in (mem.get("not_measurable") or {}).items():
            out.append(f"  {variant} rows: not measurable: {why}")
    elif mem:
        out.append(f"memory between B and W: skipped ({mem['skipped']})")
    comp = result.get("compile")
    if comp is not None:
        med = comp["median_s"]
        out.append("compile time, first step from scratch (median s): "
                   + ", ".join(f"{u} {med[u]:.1f}" for u in COMPILE_USERS)
                   + f" ({len(comp['samples_s']['inductor'])} round(s); {comp['method']})")
        regions = comp.get("region_compile_seconds")
        if regions:
            for u in COMPILE_USERS:
                last = next((x for x in reversed(regions[u]) if x), None)
                if last:
                    out.append(f"  {u}: fxsplit regions' compile_seconds " + ", ".join(
                        f"{k} {v:.1f}" for k, v in sorted(last.items())))
    return out


def format_table(result: dict[str, Any]) -> str:
    """The human-readable table printed on stdout."""
    head = ("mode", "fwd ms", "B ms", "W ms", "bwd ms", "x ind", "B GFLOP", "W GFLOP", "bwd GFLOP", "dup %",
            "held MiB", "peak MiB", "compile s")
    rows = []
    for k, r in enumerate(result["modes"], 1):
        f = r["flops"]
        g = lambda v: None if v is None else v / 1e9  # noqa: E731
        mb = lambda v: None if v is None else v / 2**20  # noqa: E731
        rows.append((
            f"{k} {r['key']}", _fmt(r["forward_ms"], ".2f"), _fmt(r["b_ms"], ".2f"), _fmt(r["w_ms"], ".2f"),
            _fmt(r["backward_ms"], ".2f"), _fmt(r["ratio_to_inductor"], ".2f"), _fmt(g(f["B"]), ".3f"),
            _fmt(g(f["W"]), ".3f"), _fmt(g(f["backward"]), ".3f"), _fmt(r["duplicated_flops_pct"], ".1f"),
            _fmt(mb(r["held_bytes"]), ".2f"), _fmt(mb(r["peak_bytes"]), ".2f"), _fmt(r["compile_s"], ".1f"),
        ))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    m = result["model"]
    out = [
        f"device: {result['device']['name']} ({result['device']['type']}, {result['device']['torch_threads']} "
        f"threads)  dtype: {result['dtype']}  torch {result['torch_version']}"
        + ("  malloc: " + result["settings"]["malloc"] if result["settings"].get("malloc", "default") != "default"
           else ""),
        f"model: {m['name']} ({m['description']}), batch={m['batch']} seq={m['seq']} layers={m['layers']} "
        f"dim={m['dim']}, {m['parameters'] / 1e6:.2f} M params",
        line(head), line(["-" * w for w in widths]), *map(line, rows),
        "",
        "x ind: total backward time / inductor's ordinary backward (mode 3). dup %: backward FLOPs above mode 3's.",
        "held MiB: live memory kept from the end of B until W; peak MiB: highest live memory above the "
        "pre-forward level (MiB = 2**20 bytes). Compiled modes' FLOPs: counted on the graphs Inductor compiles.",
    ]
    missing = result.get("not_measurable") or {}
    for k, r in enumerate(result["modes"], 1):
        if r["key"] in missing:
            out.append(f"mode {k} {r['key']}: not measurable: {missing[r['key']]}")
    if "inductor+upstream" not in missing:
        err = result["mode4_default_config_error"]
        out.append("mode 4 with AOTAutograd defaults: " + (f"FAILS: {err}" if err else "did not fail")
                   + "; measured above with donated_buffer=False.")
    out += _section_lines(result)
    for name, t in result["targets"].items():
        out.append(_verdict_line(name, t))
    if m.get("embedding"):
        out.append("note: a first stage's input needs no gradient, so upstream's split finds no intermediates and "
                   "its W computes no weight gradients (modes 2 and 4 do less work than a full backward).")
    if result["device"]["type"] == "cpu":
        out.append("CPU timings depend on load from other processes; rerun on an idle machine for final figures.")
    return "\n".join(out)
