"""grayguard.bench.probeinterval: a probe interval longer than the tick, each probe counted once against every tick."""

from __future__ import annotations

import re

import pytest

from grayguard.bench.probeinterval import main, run


def test_at_the_shipped_interval_both_count_alike_and_at_5s_each_probe_once_cuts_less(capsys):
    assert main(["--intervals", "1,5", "--chances", "0.1", "--seeds", "1", "--minutes", "3"]) == 0
    rows = dict(re.findall(r"probe every (\d+) s, slow 10%: (\d+ -> \d+)", capsys.readouterr().out))
    every, once = (int(x) for x in rows["1"].split(" -> "))
    assert every == once  # a probe a second, a tick a second: each tick reads another probe
    every, once = (int(x) for x in rows["5"].split(" -> "))
    assert once < every  # a probe read on five ticks was a run of five


def test_a_pool_without_slow_probes_is_never_cut():
    assert run(5.0, 0.0, 1, identity=False, seconds=120) == run(5.0, 0.0, 1, identity=True, seconds=120) == 0


@pytest.mark.parametrize("argv", [["--intervals", "0"], ["--chances", "2"], ["--seeds", "x"], ["--minutes", "0"]])
def test_bad_flags_exit_2_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err
