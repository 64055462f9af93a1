"""The server binary as a user first meets it: its command line."""

from __future__ import annotations

import subprocess

from launcher import binary


def test_help_lists_the_servers_flags() -> None:
    # abseil's --help shows only flags of files named after the program unless told otherwise.
    result = subprocess.run(
        [str(binary()), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    text = result.stdout + result.stderr
    assert "No flags matched" not in text
    for flag in ("--listen_address", "--config", "--metrics_port", "--backend"):
        assert flag in text, text
    assert "Flags from server/main.cc" in text  # no build machine path
