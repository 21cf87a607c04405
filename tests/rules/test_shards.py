"""rules/shards.py and `grayguard rules shards`: the pools split as Prometheus' hashmod splits them (checked against two
real Prometheus servers in tests/controller/test_prom_shard_e2e.py), the relabel_configs that keep one shard, and
bad input refused with exit 2."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from grayguard.cli import main
from grayguard.rules import shards


def test_hashmod_is_prometheus_md5_low_64_bits():
    # the values the real Prometheus 2.42 gave (tests/controller/test_prom_shard_e2e.py keeps p1, p7 | p0, p2)
    assert [shards.hashmod(p, 2) for p in ("p0", "p1", "p2", "p7")] == [1, 0, 1, 0]
    assert shards.hashmod("anything", 1) == 0
    with pytest.raises(ValueError, match="modulus"):
        shards.hashmod("p0", 0)


@given(st.lists(st.text(min_size=1, max_size=20), unique=True, max_size=30), st.integers(1, 8))
def test_assign_puts_every_pool_in_exactly_its_hashmod_shard(pools, n):
    split = shards.assign(pools, n)
    assert len(split) == n and sorted(p for s in split for p in s) == sorted(pools)
    assert all(shards.hashmod(p, n) == k for k, s in enumerate(split) for p in s)


def test_relabel_configs_keep_one_shard():
    rc = shards.relabel_configs(1, 3)
    assert rc[0] == {"source_labels": ["pool"], "modulus": 3, "target_label": "__tmp_grayguard_shard",
                     "action": "hashmod"}
    assert rc[1] == {"source_labels": ["__tmp_grayguard_shard"], "regex": "1", "action": "keep"}
    with pytest.raises(ValueError, match="shard"):
        shards.relabel_configs(3, 3)


def test_the_command_prints_each_shards_pools_and_relabelling(tmp_path, capsys):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(yaml.safe_dump({"pools": [{"name": p, "backend": f"be_{p}"} for p in ("p0", "p1", "p2", "p7")]}))
    assert main(["rules", "shards", "--config.file", str(cfg), "--shards", "2"]) == 0
    out = capsys.readouterr().out
    assert "shard 0: 2 pools: p1, p7" in out and "shard 1: 2 pools: p0, p2" in out
    assert out.count("action: hashmod") == 2 and "regex: '1'" in out


def test_the_command_refuses_bad_input_with_exit_2_and_warns_of_an_empty_shard(tmp_path, capsys):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(yaml.safe_dump({"pools": [{"name": "p0", "backend": "be"}]}))
    assert main(["rules", "shards", "--config.file", str(cfg), "--shards", "0"]) == 2
    assert "--shards: must be >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"pools": [{"name": "p0"}]}))
    assert main(["rules", "shards", "--config.file", str(bad), "--shards", "2"]) == 2
    assert "pools[0]" in capsys.readouterr().err
    assert main(["rules", "shards", "--config.file", str(cfg), "--shards", "2"]) == 0
    assert "shard 0 has no pool" in capsys.readouterr().err
