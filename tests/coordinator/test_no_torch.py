"""The coordinator holds no weights: importing it (and its command line) must not load torch."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import coordinator.main, coordinator.service, coordinator.workers
import coordinator.discovery.dns, coordinator.discovery.endpointslices, coordinator.discovery.workers_file
import kubernetes.client, kubernetes.watch  # the EndpointSlice watch runs in the coordinator
import tandem.cli
tandem.cli.build_parser()  # every subcommand's flags, as `tandem serve coordinator --help` builds them
heavy = sorted(m for m in ("torch", "transformers.modeling_utils") if m in sys.modules)
print(",".join(heavy) or "none")
"""


def test_importing_the_coordinator_loads_no_torch():
    # A fresh interpreter: this test process has torch loaded already.
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"
