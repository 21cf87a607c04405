"""What an etcd connection error tells the operator to check (grayguard.etcdconn.hint)."""

import pytest

from grayguard.etcdconn import hint


@pytest.mark.parametrize("detail", [
    "('Connection aborted.', RemoteDisconnected('Remote end closed connection without response'))",
    "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))",
])
def test_a_plain_request_to_a_tls_port_asks_whether_etcd_serves_https(detail):
    """etcd's TLS port closes a plain HTTP request's connection, cleanly or with a reset as the timing goes: both
    read as the same question (a reset was seen in CI, where only the clean close had been)."""
    assert hint(detail) == " (does etcd serve https:// there?)"


def test_an_unrelated_error_gets_no_hint():
    assert hint("('Connection aborted.', TimeoutError('timed out'))") == ""
