"""What prints takes its stream at the call (sys.stdout as it is then), never one bound at import: a default of
`out=sys.stdout` keeps the stream of the moment the module was imported, so a caller that redirected stdout after
(contextlib.redirect_stdout, pytest's capture) got nothing, and once that first stream was closed every call raised
ValueError (found in bench/cli.py's execute(), then these)."""

import contextlib
import inspect
import io

import pytest

from grayguard.controller.cmd_controller import print_plan
from grayguard.controller.loop import TickResult
from grayguard.demo import cli as demo_cli
from grayguard.demo import membership
from grayguard.localstack import soak


def test_print_plan_writes_to_the_stdout_of_the_call():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_plan(TickResult(held="no fresh data for any pool"))
    assert buf.getvalue().splitlines() == ["HOLD: no fresh data for any pool", "plan: no changes"]


def test_print_plan_to_a_stream_given():
    buf = io.StringIO()
    print_plan(TickResult(standby="another replica leads"), out=buf)
    assert buf.getvalue().startswith("STANDBY: another replica leads")


@pytest.mark.parametrize("fn", [print_plan, soak.run_soak, soak.main, demo_cli.run_scenario, demo_cli.compare,
                                membership.run_scenario], ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_no_stream_is_bound_at_import(fn):
    # these bring a whole stack up: what is checked is that none holds the stream of its import as its default
    assert inspect.signature(fn).parameters["out"].default is None
