"""What one message may announce (impl/_framing.py: ``MAX_MESSAGE_BYTES``, ``check_announced``): checked
on the decoded header, before a receive buffer is allocated. The link-level behaviour (the link fails,
the receiver's other links keep working) is in tests/gloo/test_failure_gloo.py."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import pytest
from twinrpc.impl._framing import (
    MAX_MESSAGE_BYTES,
    FrameError,
    FrameTooLarge,
    Header,
    check_announced,
    encode_header,
    new_header_tensor,
)

from twinrpc._message import Kind, Message

PEER = "'worker0' (rank 0)"


def _header(msg: Message, announce: int | None = None) -> Header:
    t, view = new_header_tensor()
    encode_header(view, msg)
    if announce is not None:
        struct.pack_into("<Q", view, 24, announce)  # the payload length field
    return Header(view, 0, 1, t)


def test_a_header_announcing_more_than_the_bound_is_refused_naming_the_peer_and_sizes() -> None:
    header = _header(Message(Kind.CALL, 3, 0, 1, b"x" * 5000), announce=1 << 50)
    expected = re.escape(f"{PEER} announced a CALL message of {1 << 50} B")
    with pytest.raises(FrameTooLarge, match=expected) as info:
        check_announced(header, PEER, MAX_MESSAGE_BYTES)
    assert isinstance(info.value, FrameError) and f"{MAX_MESSAGE_BYTES} B" in str(info.value)


def test_storages_count_toward_the_bound_and_inline_bytes_do_not() -> None:
    big = Message(Kind.CALL, 3, 0, 1, b"p", [])
    header = _header(big)
    header.sizes = [600, 500]  # as if two storages followed as data frames
    with pytest.raises(FrameTooLarge, match="2 storages"):
        check_announced(header, PEER, 1000)
    check_announced(header, PEER, 1101)  # payload inline: only the 1,100 B of storages still come
    check_announced(_header(Message(Kind.CALL, 3, 0, 1, b"x" * 100)), PEER, 10)  # all inside the header


def test_the_bound_defaults_to_physical_memory_and_the_environment_sets_it() -> None:
    assert os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") == MAX_MESSAGE_BYTES
    code = "from twinrpc.impl._framing import MAX_MESSAGE_BYTES; print(MAX_MESSAGE_BYTES)"
    env = {**os.environ, "TWINRPC_MAX_MESSAGE_BYTES": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "12345"
    env["TWINRPC_MAX_MESSAGE_BYTES"] = "lots"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "TWINRPC_MAX_MESSAGE_BYTES must be a positive number" in bad.stderr
