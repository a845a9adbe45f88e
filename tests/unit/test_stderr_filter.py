"""Mooncake's set-up noise is dropped at the file-descriptor level; everything else written
to stderr meanwhile still reaches it, in order."""

from __future__ import annotations

import os

from transfer.data.mooncake.client import SETUP_NOISE, stderr_without


def test_setup_noise_is_dropped_and_the_rest_passes(capfd):
    with stderr_without(SETUP_NOISE):
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
        os.write(2, b"E1203 transfer_metadata_plugin.cpp:292] GET ... http=404 body: metadata not found\n")
        os.write(2, b"E1203 client.cpp:10] RPC to the master failed\n")
        os.write(2, b"W1203 transfer_metadata.cpp:1115] Failed to retrieve segment descriptor, name x\n")
        os.write(2, b"W1203 real warning\n")
    os.write(2, b"after\n")
    kept = "E1203 client.cpp:10] RPC to the master failed\nW1203 real warning\nafter\n"
    assert capfd.readouterr().err == kept
