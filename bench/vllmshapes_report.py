"""The shapes' report (pure): ratios to each engine's own baseline, the controller's batch model fitted, the table,
the plot and the files of `python -m grayguard.bench.vllmshapes --out DIR`.

The batch model is the controller's (`thresholds.live_batch_slope`, docs/architecture.md): ITL(b) = a·(1 + slope·(b−1)),
fitted by least squares on the mean ITL per batch size; sim/model.py's own slope is decode_s_per_seq / decode_s_base.
The "sim/model.py" column is what the latency model gives on paper at its defaults, so a gap between it and the
measured simulator is the harness's (the client, the loop, the machine), not the model's.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

from grayguard.config import ThresholdsConfig
from grayguard.sim.model import ModelParams
from grayguard.svgplot import bar_chart, line_chart

ENGINES = {"real": "real vLLM", "sim": "simulator"}
MODEL = "sim/model.py on paper"
COLORS = {"real vLLM": "#1f77b4", "real vLLM, /metrics": "#9ecae1", "simulator": "#ff7f0e",
          "simulator, /metrics": "#fdd0a2", MODEL: "#2ca02c"}  # one color per engine in every panel
CONTROLLER_SLOPE = ThresholdsConfig().live_batch_slope
PROBE_BEHIND_S = 0.02  # the probe is sent this long after the long prompt (tokenizing 4,000 words: a few ms)


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = intercept + coef·x: (intercept, coef, R²); R² is 1.0 for a perfect or a flat line."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError("a fit needs two points or more, as many x as y")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs two distinct x")
    coef = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - coef * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - coef * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return intercept, coef, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def quadratic_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = c0 + c1·x + c2·x² (three distinct x or more): (c0, c1, c2)."""
    if len(set(xs)) < 3 or len(ys) != len(xs):
        raise ValueError("a quadratic fit needs three distinct x, as many x as y")
    s = [sum(x ** k for x in xs) for k in range(5)]
    t = [sum(y * x ** k for x, y in zip(xs, ys, strict=True)) for k in range(3)]
    m = [[s[i + j] for j in range(3)] for i in range(3)]

    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))
    d = det(m)
    return tuple(det([[t[i] if j == k else m[i][j] for j in range(3)] for i in range(3)]) / d  # type: ignore[return-value]
                 for k in range(3))


def fit_batch(points: Sequence[tuple[int, float]]) -> dict | None:
    """The controller's model ITL = a·(1 + slope·(b−1)) fitted to (b, ITL): a, slope, R², the worst relative miss."""
    pts = [(b, v) for b, v in points if v is not None]
    if len({b for b, _ in pts}) < 2:
        return None
    a, c, r2 = linear_fit([b - 1 for b, _ in pts], [v for _, v in pts])
    worst = max(abs(v - (a + c * (b - 1))) / v for b, v in pts)
    return {"a_s": a, "slope": c / a if a > 0 else None, "r2": r2, "max_rel_miss": worst}


def fit_prefill(points: Sequence[tuple[int, float]]) -> dict | None:
    """TTFT = t0 + cost·tokens fitted to (prompt tokens, TTFT); fixed_share = t0 / TTFT at the longest prompt."""
    pts = [(n, v) for n, v in points if v is not None]
    if len({n for n, _ in pts}) < 2:
        return None
    t0, c, r2 = linear_fit([n for n, _ in pts], [v for _, v in pts])
    n_max, v_max = max(pts)
    out = {"t0_s": t0, "s_per_token": c, "r2": r2, "fixed_share": t0 / v_max if v_max > 0 else None,
           "quadratic_share": None}
    if len({n for n, _ in pts}) >= 3:  # attention is quadratic in the prompt: its share of the longest TTFT
        q = quadratic_fit([n for n, _ in pts], [v for _, v in pts])
        out |= {"quadratic": q, "quadratic_share": q[2] * n_max ** 2 / v_max if v_max > 0 else None}
    return out


def ratios(values: Sequence[float | None], base: float | None) -> list[float | None]:
    """Each value over the baseline; None where either is absent (absent is not zero)."""
    return [v / base if v is not None and base else None for v in values]


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _med(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def derive_engine(raw: dict) -> dict:
    """One engine's ratios and fits from its raw numbers (any phase may be missing)."""
    d: dict = {}
    if raw.get("batch"):
        rows = sorted(raw["batch"], key=lambda r: r["b"])
        bs = [r["b"] for r in rows]
        base = rows[0] if bs[0] == 1 else None
        col = {k: [r[k] for r in rows] for k in ("itl_mean_s", "itl_median_s", "server_itl_mean_s", "ttft_median_s")}
        # the run-to-run noise: the largest max/min of one batch size's runs' mean ITLs
        spread = [max(v) / min(v) for r in rows if len(v := [x for x in r.get("itl_mean_reps_s", []) if x]) > 1]
        d["batch"] = {"b": bs, "rep_spread": max(spread, default=None),
                      **{k.removesuffix("_s") + "_ratio": ratios(v, base and base[k]) for k, v in col.items()},
                      "fit": fit_batch(list(zip(bs, col["itl_mean_s"], strict=True))),
                      "fit_server": fit_batch(list(zip(bs, col["server_itl_mean_s"], strict=True)))}
    if raw.get("prompt"):
        rows = sorted(raw["prompt"], key=lambda r: r["tokens"])
        ns, ts = [r["tokens"] for r in rows], [r["ttft_median_s"] for r in rows]
        d["prompt"] = {"tokens": ns, "ttft_ratio": ratios(ts, ts[0]),
                       "fit": fit_prefill(list(zip(ns, ts, strict=True)))}
    p = raw.get("prefill")
    if p:
        reps = [r for r in p["reps"] if "error" not in r]
        idle = _med(p["probe_idle_s"])
        steady = _med([r["steady_itl_s"] for r in reps])
        long_idle = next((r["ttft_median_s"] for r in raw.get("prompt", []) if r["tokens"] == raw["long_prompt"]),
                         None) if "long_prompt" in raw else None
        d["prefill"] = {"longest_gap_ratio": _div(_med([r["longest_gap_s"] for r in reps]), steady),
                        "stall_ratio": _div(_med([r["stall_s"] for r in reps]), long_idle),
                        "long_steps": _med([r["long_steps"] for r in reps]),
                        "long_ttft_beside_ratio": _div(_med([r["long_ttft_s"] for r in reps]), long_idle),
                        "probe_beside_ratio": _div(_med([r["probe_beside_s"] for r in reps]), idle),
                        "probe_behind_ratio": _div(_med([r["probe_behind_s"] for r in reps]), idle),
                        "probe_behind_after_long": sum(r["probe_after_long"] for r in reps), "reps": len(reps)}
    t = raw.get("thermal")
    if t and "fault" in t:
        d["thermal"] = {k.removesuffix("_s") + "_ratio": _div(t["fault"][k], t["base"][k]) for k in t["base"]}
        # the real node's CPU time a token (all its processes) against its ITL: under a quota of 1/k core a token
        # takes at least k times the CPU it uses, so k x (CPU a token under the quota) / (healthy ITL) is the ITL
        # ratio the quota explains
        cpu_fault = t["fault"].get("cpu_per_token_b1_s")
        d["thermal"] |= {"cpu_wall_b1": _div(t["base"].get("cpu_per_token_b1_s"), t["base"]["itl_b1_s"]),
                         "quota_bound_b1": _div(cpu_fault and t["k"] * cpu_fault, t["base"]["itl_b1_s"])}
    return d


def model_expectation(g: dict, p: ModelParams | None = None) -> dict:
    """What sim/model.py gives on paper (no jitter, no client) for the same grid, at its defaults."""
    p = p or ModelParams()

    def step(members: int, prefill: int = 0) -> float:
        return p.decode_s_base + p.decode_s_per_seq * (members - 1) + p.prefill_s_per_token * prefill
    bs, ns, s = list(g["batches"]), list(g["prompts"]), g["prefill_streams"]
    # a prompt within the step's token budget is one step with its own decode slot; the long one's step carries
    # the running decodes too
    lp, q = g["long_prompt"], g["probe_prompt"]
    long_step, idle = step(s + 1, min(lp, p.max_num_batched_tokens - s)), step(1, q)
    # a request arriving mid-step waits half a step on average; the probe behind arrives PROBE_BEHIND_S into the
    # long prompt's step and is prefilled in the step after it, beside the decodes
    return {"batch": {"b": bs, "itl_mean_ratio": [step(b) / step(1) for b in bs],
                      "fit": {"slope": p.decode_s_per_seq / p.decode_s_base, "r2": 1.0}},
            "prompt": {"tokens": ns, "ttft_ratio": [step(1, n) / step(1, ns[0]) for n in ns],
                       "fit": {"r2": 1.0, "fixed_share": step(1, 0) / step(1, max(ns)), "quadratic_share": 0.0}},
            "prefill": {"longest_gap_ratio": long_step / step(s),
                        "stall_ratio": (long_step - step(s)) / step(1, lp),
                        "long_steps": float(-(-lp // (p.max_num_batched_tokens - s))),
                        "long_ttft_beside_ratio": (step(s) / 2 + long_step) / step(1, lp),
                        "probe_beside_ratio": (step(s) / 2 + step(s + 1, q)) / idle,
                        "probe_behind_ratio": (long_step - PROBE_BEHIND_S + step(s + 1, q)) / idle},
            "thermal": {k: g["thermal_k"] for k in ("itl_b1_ratio", "itl_batch_ratio", "ttft_ratio", "probe_ratio")}}


def derive(result: dict) -> dict:
    """The result with `derived`: per engine (and the model on paper) the ratios and fits."""
    g = result["meta"]["grid"]
    for raw in result["engines"].values():
        raw.setdefault("long_prompt", g["long_prompt"])
    derived = {e: derive_engine(raw) for e, raw in result["engines"].items()}
    derived["model"] = model_expectation(g)
    return {**result, "derived": derived, "controller_slope": CONTROLLER_SLOPE}


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


def _get(d: dict, *path: str | int) -> float | None:
    for k in path:
        if isinstance(d, dict) and isinstance(k, str):
            d = d.get(k)
        elif isinstance(d, list) and isinstance(k, int) and k < len(d):
            d = d[k]
        else:
            return None
        if d is None:
            return None
    return d  # type: ignore[return-value]


def table_rows(result: dict) -> list[tuple[str, list[str]]]:
    """(quantity, one cell per column: each engine measured, then the model on paper)."""
    der, g = result["derived"], result["meta"]["grid"]
    cols = [*result["engines"], "model"]
    rows: list[tuple[str, list[str]]] = []

    def add(label: str, *path: str | int, fmt: str = "{:.2f}") -> None:
        rows.append((label, [_f(_get(der[c], *path), fmt) for c in cols]))
    for i, b in enumerate(g["batches"][1:], 1):
        add(f"ITL(b={b}) / ITL(1), client", "batch", "itl_mean_ratio", i)
    for i, b in enumerate(g["batches"][1:], 1):
        add(f"ITL(b={b}) / ITL(1), vLLM's own histogram", "batch", "server_itl_mean_ratio", i)
    add("run-to-run noise: the largest max / min of one batch size's runs", "batch", "rep_spread")
    add("fitted slope, ITL = a·(1 + slope·(b−1)), client", "batch", "fit", "slope", fmt="{:.4f}")
    add("R² of that fit", "batch", "fit", "r2", fmt="{:.3f}")
    add("fitted slope, vLLM's own histogram", "batch", "fit_server", "slope", fmt="{:.4f}")
    add(f"TTFT of {g['batches'][-1]} streams sent at once / of one", "batch", "ttft_median_ratio", -1)
    for i, n in enumerate(g["prompts"][1:], 1):
        add(f"TTFT(prompt {n}) / TTFT(prompt {g['prompts'][0]})", "prompt", "ttft_ratio", i)
    add("TTFT = t0 + cost·tokens: R²", "prompt", "fit", "r2", fmt="{:.3f}")
    add(f"t0 / TTFT(prompt {max(g['prompts'])}) (the fixed part)", "prompt", "fit", "fixed_share")
    add(f"c2·n² / TTFT(prompt {max(g['prompts'])}), TTFT = c0 + c1·n + c2·n² (the quadratic part)", "prompt", "fit",
        "quadratic_share")
    lp, s = g["long_prompt"], g["prefill_streams"]
    add(f"{s} decoding streams, a {lp}-token prompt arrives: longest gap / steady ITL", "prefill",
        "longest_gap_ratio")
    add("the streams' stall (time beyond steady ITL) / its TTFT alone", "prefill", "stall_ratio")
    add("long steps (gaps over 3x steady ITL) while it prefills", "prefill", "long_steps", fmt="{:.0f}")
    add(f"its TTFT beside {s} decodes / alone", "prefill", "long_ttft_beside_ratio")
    add(f"probe TTFT beside {s} decodes / idle", "prefill", "probe_beside_ratio")
    add("probe TTFT just behind the long prompt / idle", "prefill", "probe_behind_ratio")
    k = g["thermal_k"]
    add(f"thermal k={k:g}: ITL(b=1) / healthy", "thermal", "itl_b1_ratio")
    add(f"thermal k={k:g}: ITL(b={g['thermal_batch']}) / healthy", "thermal", "itl_batch_ratio")
    add(f"thermal k={k:g}: TTFT(prompt {g['thermal_prompt']}) / healthy", "thermal", "ttft_ratio")
    add(f"thermal k={k:g}: probe TTFT / healthy", "thermal", "probe_ratio")
    add("healthy: CPU time a token (all the node's processes) / ITL, b=1", "thermal", "cpu_wall_b1")
    add(f"thermal k={k:g}: CPU time a token / healthy, b=1", "thermal", "cpu_per_token_b1_ratio")
    add(f"k x CPU a token under the quota / healthy ITL: the ITL ratio a 1/{k:g}-core quota explains", "thermal",
        "quota_bound_b1")
    return rows


def baseline_rows(result: dict) -> list[tuple[str, list[str]]]:
    """The absolute baselines each engine's ratios divide by (ms)."""
    eng, g = result["engines"], result["meta"]["grid"]

    def ms(e: str, phase: str, key: str, pick: str, at: int) -> str:
        row = next((r for r in eng[e].get(phase) or [] if r[pick] == at), None)
        return _f(row and row[key] and 1000 * row[key], "{:.1f}")
    n0, n1 = g["prompts"][0], g["prompts"][-1]
    return [("ITL(b=1), client (ms)", [ms(e, "batch", "itl_mean_s", "b", 1) for e in eng]),
            ("ITL(b=1), the engine's histogram (ms)", [ms(e, "batch", "server_itl_mean_s", "b", 1) for e in eng]),
            (f"TTFT(prompt {n0}) (ms)", [ms(e, "prompt", "ttft_median_s", "tokens", n0) for e in eng]),
            (f"TTFT(prompt {n1}) (ms)", [ms(e, "prompt", "ttft_median_s", "tokens", n1) for e in eng])]


def markdown(result: dict) -> str:
    """The ratio table and the baselines, as Markdown, with the run's conditions."""
    m, names = result["meta"], [ENGINES[e] for e in result["engines"]]
    out = ["| quantity | " + " | ".join([*names, MODEL]) + " |",
           "|---|" + "---|" * (len(names) + 1)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in table_rows(result)]
    out += ["", f"Controller: `live_batch_slope` {result['controller_slope']:g}.", "",
            "| baseline | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in baseline_rows(result)]
    la0, la1 = m["loadavg_start"], m["loadavg_end"]
    out += ["", f"Run {m['started']}, {m['wall_s']:.0f} s, {m['cpus']} CPUs, load average {la0[0]:.1f} at the start "
            f"and {la1[0]:.1f} at the end (other work on the machine shows in every number); "
            + "; ".join(f"{ENGINES[e]}: {r.get('version')}, {r.get('wall_s')} s" for e, r in result["engines"].items())
            + "."]
    return "\n".join(out) + "\n"


def _nest(svg: str, y: int) -> tuple[str, int, int]:
    w, h = (int(float(re.search(rf'\b{a}="([\d.]+)"', svg).group(1))) for a in ("width", "height"))  # type: ignore[union-attr]
    return svg.replace("<svg ", f'<svg x="0" y="{y}" ', 1), w, h


def svg(result: dict) -> str:
    """Three panels stacked in one SVG: ITL against the batch, TTFT against the prompt, the events' ratios."""
    der, g = result["derived"], result["meta"]["grid"]
    cols = [*result["engines"], "model"]
    label = {**ENGINES, "model": MODEL}
    batch: dict = {}
    for c in cols:
        b = der[c].get("batch")
        if b:
            batch[label[c]] = list(zip(b["b"], b["itl_mean_ratio"], strict=True))
            if b.get("server_itl_mean_ratio") and any(b["server_itl_mean_ratio"]):
                batch[label[c] + ", /metrics"] = list(zip(b["b"], b["server_itl_mean_ratio"], strict=True))
    batch[f"controller (slope {CONTROLLER_SLOPE:g})"] = [(b, 1 + CONTROLLER_SLOPE * (b - 1)) for b in g["batches"]]
    prompt = {label[c]: list(zip(der[c]["prompt"]["tokens"], der[c]["prompt"]["ttft_ratio"], strict=True))
              for c in cols if der[c].get("prompt")}
    events = {"prefill step": ("prefill", "longest_gap_ratio"),
              "probe behind": ("prefill", "probe_behind_ratio"),
              "probe beside": ("prefill", "probe_beside_ratio"),
              "thermal ITL b=1": ("thermal", "itl_b1_ratio"), f"thermal ITL b={g['thermal_batch']}":
              ("thermal", "itl_batch_ratio"), "thermal TTFT": ("thermal", "ttft_ratio"),
              "thermal probe": ("thermal", "probe_ratio")}
    groups = {name: {label[c]: _get(der[c], *path) for c in cols} for name, path in events.items()}
    controller = f"controller (slope {CONTROLLER_SLOPE:g})"
    colors = {**COLORS, controller: "#7f7f7f"}
    panels = [line_chart(batch, title="ITL(b) / ITL(1) against the decode batch", ylabel="ITL ratio",
                         xlabel="decode batch (streams at once)", x_max=max(g["batches"]), colors=colors),
              line_chart(prompt, title="TTFT(prompt) / TTFT(shortest prompt)", ylabel="TTFT ratio", log=True,
                         xlabel="prompt tokens", x_max=max(g["prompts"]), colors=colors),
              bar_chart(groups, title="Events against each engine's own baseline", ylabel="ratio",
                        xlabel="", series_order=[label[c] for c in cols], missing="not measured")]
    body, y, width = [], 0, 0
    for p in panels:
        nested, w, h = _nest(p, y)
        body.append(nested)
        y, width = y + h + 10, max(width, w)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" viewBox="0 0 {width} {y}">\n'
            + "\n".join(body) + "\n</svg>\n")


def write(result: dict, out: Path) -> list[Path]:
    """shapes.json (raw and derived), shapes.md (the tables) and shapes.svg (the plot) into out."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "shapes.json", out / "shapes.md", out / "shapes.svg"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    paths[2].write_text(svg(result))
    return paths


def ms(v: float | None) -> str:
    return "–" if v is None else f"{1000 * v:.1f} ms"


def brief(kind: str, r: dict | list) -> str:
    """One progress line for a phase's raw result."""
    if kind == "prompt":
        return f"TTFT median {ms(r['ttft_median_s'])}" + (f", errors: {r['error']}" if r.get("error") else "")
    if kind == "batch":
        return "; ".join(f"b={x['b']}: ITL {ms(x['itl_mean_s'])} (engine's own {ms(x['server_itl_mean_s'])}), TTFT "
                         f"{ms(x['ttft_median_s'])}" + (f", {x['errors']} errors" if x["errors"] else "") for x in r)
    if kind == "prefill":
        reps = [x for x in r["reps"] if "error" not in x]
        return (f"probe idle {ms(_med(r['probe_idle_s']))}, behind {ms(_med([x['probe_behind_s'] for x in reps]))}; "
                f"longest gap {ms(_med([x['longest_gap_s'] for x in reps]))} against steady "
                f"{ms(_med([x['steady_itl_s'] for x in reps]))}")
    if kind == "thermal":
        if "fault" not in r:
            return f"not measured: {r.get('error')}"
        b, f = r["base"], r["fault"]
        return (f"ITL {ms(b['itl_b1_s'])} -> {ms(f['itl_b1_s'])} (CPU a token {ms(b['cpu_per_token_b1_s'])} -> "
                f"{ms(f['cpu_per_token_b1_s'])}), TTFT {ms(b['ttft_s'])} -> {ms(f['ttft_s'])}, probe "
                f"{ms(b['probe_s'])} -> {ms(f['probe_s'])}")
    return ""
