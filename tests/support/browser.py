"""Open HTML pages in headless Chromium (DevTools protocol over aiohttp) and say what is wrong with each as a person
would see it: console errors and uncaught exceptions, raw Python or JSON structures in the visible text, plots
without axes or legend (the markup of grayguard/svgplot.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import aiohttp

from grayguard.binaries import find_binary

# `{'k': 10}`, `['a']`, `{"k"`, `[]`, `{}`: a repr or a JSON dump, not something written for a person
RAW = re.compile(r"\{'|\['|\{\"|\[\"|\[\]|\{\}")

# What the page shows (innerText: rendered text only) and, per <svg>, what its axes and legend hold.
INSPECT = """(() => {
  const txt = (root, sel) => [...root.querySelectorAll(sel)].map(n => n.textContent.trim()).filter(Boolean);
  const plots = [...document.querySelectorAll('svg')].map((svg, i) => {
    const legend = svg.querySelector('.legend');
    const box = legend ? legend.getBoundingClientRect() : null;
    return {name: (svg.querySelector('title') || {}).textContent || ('svg #' + (i + 1)),
            x_label: txt(svg, '.axis.x .axis-label'), y_label: txt(svg, '.axis.y .axis-label'),
            x_ticks: svg.querySelectorAll('.axis.x .tick').length,
            y_ticks: svg.querySelectorAll('.axis.y .tick').length,
            legend: legend ? txt(legend, '.legend-item') : null,
            legend_shown: !!box && box.width > 0 && box.height > 0,
            data: svg.querySelectorAll('.series > *').length};
  });
  return JSON.stringify({title: document.title, text: document.body ? document.body.innerText : '', plots});
})()"""


def chromium() -> str:
    """The Chromium binary (Debian `chromium`; `make deps` installs it)."""
    return find_binary("chromium", "chromium-browser", "google-chrome")


def problems(seen: dict[str, Any]) -> list[str]:
    """What is wrong with one page, from what the browser saw (pure)."""
    out = [f"console: {m}" for m in seen["errors"]]
    if not seen["title"].strip():
        out.append("no <title>")
    if not seen["text"].strip():
        out.append("nothing visible")
    for m in RAW.finditer(seen["text"]):
        out.append(f"raw structure in the text: ...{seen['text'][max(0, m.start() - 40):m.end() + 40]!r}...")
    for p in seen["plots"]:
        for what, bad in (("no x axis label", not p["x_label"]), ("no y axis label", not p["y_label"]),
                          ("fewer than 2 x ticks", p["x_ticks"] < 2), ("fewer than 2 y ticks", p["y_ticks"] < 2),
                          ("no legend", not p["legend"]),
                          ("legend not rendered", p["legend"] and not p["legend_shown"]),
                          ("no data drawn", not p["data"])):
            if bad:
                out.append(f"plot {p['name']!r}: {what}")
    return out


class _Cdp:
    """A DevTools session on one page target: commands by id, events into a list."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws, self.ids, self.pending, self.events = ws, itertools.count(1), {}, []
        self.session: str | None = None
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            m = json.loads(msg.data)
            if "id" in m and m["id"] in self.pending:
                self.pending.pop(m["id"]).set_result(m)
            elif "method" in m:
                self.events.append(m)

    async def send(self, method: str, params: dict | None = None, session: bool = True) -> dict:
        i = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        msg = {"id": i, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        await self.ws.send_str(json.dumps(msg))
        m = await asyncio.wait_for(fut, 20)
        if "error" in m:
            raise RuntimeError(f"{method}: {m['error']}")
        return m["result"]


def _error_text(ev: dict) -> str | None:
    """The message of a console error, an uncaught exception or a failed load; None for anything else."""
    p = ev["params"]
    if ev["method"] == "Runtime.exceptionThrown":
        d = p["exceptionDetails"]
        return (d.get("exception") or {}).get("description") or d.get("text")
    if ev["method"] == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
        return " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
    if ev["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
        return f"{p['entry']['text']} {p['entry'].get('url', '')}".strip()
    return None


async def _inspect(ws_url: str, pages: list[Path]) -> dict[Path, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=0) as ws:
        cdp = _Cdp(ws)
        target = (await cdp.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        cdp.session = (await cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            await cdp.send(f"{domain}.enable")
        out = {}
        for path in pages:
            cdp.events.clear()
            await cdp.send("Page.navigate", {"url": path.resolve().as_uri()})
            for _ in range(200):  # up to 10 s for the load event
                if any(ev["method"] == "Page.loadEventFired" for ev in cdp.events):
                    break
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError(f"{path}: no load event in 10 s")
            await asyncio.sleep(0.1)  # a late error (a timer, an onload handler) still counts
            res = await cdp.send("Runtime.evaluate", {"expression": INSPECT, "returnByValue": True})
            seen = json.loads(res["result"]["value"])
            seen["errors"] = [t for ev in cdp.events if (t := _error_text(ev)) is not None]
            out[path] = seen
        cdp.reader.cancel()
        return out


def _start_chromium(profile: str, wait_s: float) -> tuple[subprocess.Popen, str | None]:
    """A headless Chromium and where its DevTools listen (None: it never said so within wait_s)."""
    proc = subprocess.Popen([chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                             "--no-default-browser-check", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(wait_s, proc.kill)  # a Chromium that never says where it listens
    watchdog.start()
    try:
        for line in proc.stderr:  # Chromium says where its DevTools listen; the rest is dbus noise
            if m := re.search(r"DevTools listening on (ws://\S+)", line):
                return proc, m[1]
        return proc, None
    finally:
        watchdog.cancel()


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def inspect_pages(pages: list[Path], timeout_s: float = 60, starts: int = 2) -> dict[Path, dict[str, Any]]:
    """Open each page in one headless Chromium; what it saw of each (text, plots, errors).

    A Chromium that does not come up within 45 s is killed and started once more with a fresh profile:
    on a loaded 2-core CI machine one start in a thousand stalled (killed at 30 s, CI of 2026-12-01).
    """
    failures = []
    for _attempt in range(starts):
        profile = tempfile.mkdtemp(prefix="gg-chromium-")
        proc, ws_url = _start_chromium(profile, 45)
        drain = threading.Thread(target=proc.stderr.read, daemon=True)  # once listening: a full pipe would stall it
        try:
            if ws_url is None:
                failures.append(f"chromium exited ({proc.wait()}) without a DevTools endpoint")
                continue
            drain.start()
            return asyncio.run(asyncio.wait_for(_inspect(ws_url, pages), timeout_s))
        finally:
            _stop(proc)
            if drain.is_alive():
                drain.join(5)  # EOF now that Chromium is gone
            proc.stderr.close()
            shutil.rmtree(profile, ignore_errors=True)
    raise RuntimeError("; ".join(failures))


def check_pages(pages: list[Path]) -> dict[Path, list[str]]:
    """Each page and what is wrong with it (an empty list: it reads well)."""
    return {p: problems(seen) for p, seen in inspect_pages(pages).items()}
