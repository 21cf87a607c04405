"""grayguard.terminate: a signal's exception that Python drops in a finalizer is raised again."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procwatch import signals_at_default

REPO = Path(__file__).resolve().parents[2]
PROGRAM = """
import gc, time
from grayguard import terminate
terminate.install()
class Finalized:
    def __del__(self):  # a signal handler that runs here raises into a finalizer: Python prints it and drops it
        raise {exc}()
try:
    Finalized()
    gc.collect()
    time.sleep(10)
    print("ran on")
except KeyboardInterrupt as e:
    print("unwound", type(e).__name__)
"""


@pytest.mark.parametrize("exc, seen", [("terminate.Terminated", "unwound Terminated"),
                                       ("KeyboardInterrupt", "unwound KeyboardInterrupt")])
def test_a_signals_exception_dropped_in_a_finalizer_is_raised_again(exc, seen):
    """Seen once in CI: the soak's SIGTERM handler ran inside a WeakValueDictionary's callback, its Terminated was
    dropped, the handler had set later SIGTERMs to be ignored, and the soak ran on with its stack."""
    out = subprocess.run([sys.executable, "-c", PROGRAM.format(exc=exc)], cwd=REPO, capture_output=True, text=True,
                         timeout=30, preexec_fn=signals_at_default)
    assert seen in out.stdout and "ran on" not in out.stdout, out.stdout + out.stderr
