"""Rank 0's rendezvous keeps its port from the moment it is chosen until the group uses
it: nothing else can bind it in between (the probed-then-released port could be)."""

import errno
import socket

import pytest

from rlserve.core.process_group import open_rendezvous


def test_the_rendezvous_port_cannot_be_taken_before_the_ranks_meet():
    store = open_rendezvous()
    with socket.socket() as other, pytest.raises(OSError) as error:
        other.bind(("", store.port))
    assert error.value.errno == errno.EADDRINUSE
    store.set("rank1", "here")  # and it serves the ranks that connect to it
    assert store.get("rank1") == b"here"
