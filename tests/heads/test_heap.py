"""The training loop's heap trim reaches glibc's malloc_trim where there is one."""

from __future__ import annotations

import platform
import sys

import pytest

from tandem.heads.train.heap import release_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's")
def test_glibc_trims() -> None:
    blocks = [bytearray(1 << 20) for _ in range(64)]  # 64 MB on the heap, then freed
    del blocks
    assert release_freed_memory()
