"""RuleRerenderer: learned baselines from Prometheus (faked with `responses`), write only on change,
promtool before replace, exactly one /-/reload per change."""

import os

import pytest
import responses

from grayguard.config import parse_config
from grayguard.rules.render import ALERTS_FILE, RECORDING_FILE, baseline_query, render_all
from grayguard.rules.rerender import RuleRerenderer, check_rule_files, write_if_changed
from tests.support.stack import require

PROM = "http://prom.test:9090"
QUERY = f"{PROM}/api/v1/query"
RELOAD = f"{PROM}/-/reload"


def make_cfg(**rules):
    return parse_config({"pools": [{"name": "chat", "backend": "vllm_chat"}, {"name": "code", "backend": "vllm_code"}],
                         "prometheus": {"url": PROM}, "rules": {"rerender_interval_s": 300, **rules}})


def vector(**baselines):
    return {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"pool": p}, "value": [1700000000, str(v)]} for p, v in baselines.items()]}}


@pytest.fixture
def cfg():
    return make_cfg()


@pytest.fixture
def out(tmp_path, cfg):
    """An output dir holding the files rendered with chat's baseline at 0.5 s."""
    write_if_changed(tmp_path, render_all(cfg, {"chat": 0.5}), promtool=None)
    return tmp_path


@pytest.fixture
def prom():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        yield rsps


def reloads(rsps):
    return [c for c in rsps.calls if c.request.method == "POST"]


def snapshot(d):
    return {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in sorted(d.iterdir())}


def test_changed_baseline_rewrites_and_reloads_once(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.9))
    prom.post(RELOAD, status=200)
    rr = RuleRerenderer(cfg, out, PROM)
    res = rr.maybe_rerender(now=1000.0)
    assert (res.changed, res.reloaded, res.error, res.files) == (True, True, None, (ALERTS_FILE,))
    assert len(reloads(prom)) == 1
    assert prom.calls[0].request.params["query"] == baseline_query(cfg)
    assert 'p99_rate5m{pool="chat"} > 2 * 0.9' in (out / ALERTS_FILE).read_text()
    assert (out / ALERTS_FILE).stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in out.iterdir()) == [ALERTS_FILE, RECORDING_FILE]  # no temp files left


def test_unchanged_render_writes_nothing_and_does_not_reload(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.5049))  # rounds to the 0.5 already rendered
    before = snapshot(out)
    res = RuleRerenderer(cfg, out, PROM).maybe_rerender(now=1000.0)
    assert (res.changed, res.reloaded, res.error) == (False, False, None)
    assert reloads(prom) == []
    assert snapshot(out) == before


def test_invalid_render_never_replaces_the_good_file(cfg, out, prom):
    require("promtool")
    prom.get(QUERY, json=vector(chat=0.9))
    prom.post(RELOAD, status=200)

    def broken(c, baselines):  # a template bug: a syntactically broken PromQL expression
        files = render_all(c, baselines)
        files[ALERTS_FILE] = files[ALERTS_FILE].replace("== 1", "== == 1")
        return files

    before = snapshot(out)
    res = RuleRerenderer(cfg, out, PROM, render=broken).maybe_rerender(now=1000.0)
    assert (res.changed, res.reloaded) == (False, False)
    assert "promtool check rules failed" in res.error
    assert reloads(prom) == []
    assert snapshot(out) == before


def test_invalid_yaml_is_rejected_even_without_promtool(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.9))
    before = snapshot(out)
    rr = RuleRerenderer(cfg, out, PROM, promtool="no-such-promtool-binary",
                        render=lambda c, b: {ALERTS_FILE: "groups: [unclosed\n", RECORDING_FILE: "x: 1\n"})
    res = rr.maybe_rerender(now=1000.0)
    assert res.error and "not valid YAML" in res.error
    assert snapshot(out) == before and reloads(prom) == []


def test_one_bad_file_blocks_the_good_one_too(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.9))

    def half_broken(c, baselines):
        files = render_all(c, baselines)
        files[RECORDING_FILE] = "not: a rule file\n"
        return files

    before = snapshot(out)
    res = RuleRerenderer(cfg, out, PROM, promtool="no-such-promtool-binary", render=half_broken).rerender()
    assert "no `groups:` list" in res.error
    assert snapshot(out) == before


def test_render_exception_is_an_error_not_a_crash(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.9))

    def boom(c, b):
        raise RuntimeError("template bug")

    res = RuleRerenderer(cfg, out, PROM, render=boom).rerender()
    assert res == res.__class__(False, False, "render failed: template bug")


def test_interval_gates_the_work(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.5))
    clock = [1000.0]
    rr = RuleRerenderer(cfg, out, PROM, clock=lambda: clock[0])
    assert rr.due(1000.0)
    rr.maybe_rerender()
    assert len(prom.calls) == 1
    clock[0] += 299
    assert rr.maybe_rerender() == rr.maybe_rerender(now=1100.0)
    assert len(prom.calls) == 1  # not due: no query at all
    clock[0] += 1
    rr.maybe_rerender()
    assert len(prom.calls) == 2


def test_interval_zero_never_rerenders(out, prom):
    rr = RuleRerenderer(make_cfg(rerender_interval_s=0), out, PROM)
    assert not rr.maybe_rerender(now=1.0).changed
    assert len(prom.calls) == 0


def test_query_failure_keeps_the_files(cfg, out, prom):
    prom.get(QUERY, status=503, body="overloaded")
    before = snapshot(out)
    res = RuleRerenderer(cfg, out, PROM).maybe_rerender(now=1000.0)
    assert (res.changed, res.reloaded) == (False, False)
    assert "baseline query failed (http_5xx)" in res.error
    assert snapshot(out) == before and reloads(prom) == []


def test_empty_and_nan_results_drop_regression_alerts(cfg, out, prom):
    prom.get(QUERY, json=vector(chat="NaN"))
    prom.post(RELOAD, status=200)
    res = RuleRerenderer(cfg, out, PROM).rerender()
    assert res.changed and res.reloaded
    assert "GrayguardTtftRegression" not in (out / ALERTS_FILE).read_text()


def test_failed_reload_is_retried_until_it_succeeds(cfg, out, prom):
    prom.get(QUERY, json=vector(chat=0.9))
    prom.post(RELOAD, status=500, body="lifecycle API disabled")
    rr = RuleRerenderer(cfg, out, PROM)
    res = rr.maybe_rerender(now=1000.0)
    assert (res.changed, res.reloaded) == (True, False)
    assert "HTTP 500" in res.error
    prom.replace(responses.POST, RELOAD, status=200)
    res = rr.maybe_rerender(now=1300.0)  # same content: nothing written, but the reload is still owed
    assert (res.changed, res.reloaded, res.error) == (False, True, None)
    assert len(reloads(prom)) == 2
    res = rr.maybe_rerender(now=1600.0)
    assert (res.changed, res.reloaded) == (False, False)
    assert len(reloads(prom)) == 2


def test_reload_url_and_auth(tmp_path, prom, monkeypatch):
    cfg = parse_config({"pools": [{"name": "chat", "backend": "b"}],
                        "prometheus": {"url": "https://thanos.test", "bearer_token_env": "TOKEN"},
                        "rules": {"reload_url": "http://local-prom:9090/-/reload"}})
    prom.get("https://thanos.test/api/v1/query", json=vector(chat=0.3))
    prom.post("http://local-prom:9090/-/reload", status=200)
    res = RuleRerenderer(cfg, tmp_path, environ={"TOKEN": "s3cret"}).rerender()
    assert res.changed and res.reloaded
    assert all(c.request.headers["Authorization"] == "Bearer s3cret" for c in prom.calls)
    assert sorted(os.listdir(tmp_path)) == [ALERTS_FILE, RECORDING_FILE]


def test_check_rule_files_runs_promtool(tmp_path):
    require("promtool")
    good = tmp_path / "good.yml"
    good.write_text(render_all(make_cfg())[ALERTS_FILE])
    check_rule_files([good], "promtool")
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: g\n    rules:\n      - record: x\n        expr: sum(\n")
    with pytest.raises(Exception, match="promtool check rules failed"):
        check_rule_files([bad], "promtool")
