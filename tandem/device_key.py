"""Which compute a worker's model runs on, as a key two workers' keys are compared by (``WorkerInfo.device_key``).

A draft worker beside its target on one machine (`tandem up`, a local cluster) takes compute from the target's
verifications with each of its steps: on a 2-core CPU the two processes run one after the other, and on one GPU
their kernels share its time. On a device of its own (a draft pod on a small GPU) it takes nothing from the
target. Adaptive k prices a draft step apart in the two cases (``tandem.spec.adaptive.LoadAwareCost``), so each
worker says what it computes on, and the coordinator compares the two keys (``shares_device``).

A key is ``<kind>:<machine>:<units>``: the kind of device ("cpu", "cuda", ...), the machine (the kernel's boot
id, which the containers of one node share, else the host name), and the units the model may use there (the CPUs
of the process's affinity; a GPU's UUID). Two keys share a device when kind and machine are equal and their units
overlap: two processes pinned to disjoint cores share nothing.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def device_key(device: Any) -> str:
    """The key of ``device`` (a ``torch.device``) as this process uses it."""
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)  # (older PyTorch: none; then the machine and the index tell it)
        unit = str(uuid) if uuid else str(device.index if device.index is not None else torch.cuda.current_device())
        return f"cuda:{_machine()}:{unit}"
    if device.type == "cpu":
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        return f"cpu:{_machine()}:{','.join(map(str, cpus))}"
    return f"{device.type}:{_machine()}:{device.index if device.index is not None else 0}"


@functools.lru_cache(maxsize=256)  # (asked every round of every request, of a few pairs of keys: parsed once a pair)
def shares_device(a: str, b: str) -> bool:
    """Whether workers with keys ``a`` and ``b`` compute on the same device (False where either key is empty or
    malformed: a worker that does not say is taken to have its own)."""
    parsed_a, parsed_b = _parse(a), _parse(b)
    if parsed_a is None or parsed_b is None:
        return False
    (kind_a, machine_a, units_a), (kind_b, machine_b, units_b) = parsed_a, parsed_b
    if kind_a != kind_b or machine_a != machine_b:
        return False
    return not units_a or not units_b or bool(units_a & units_b)  # (no units said: the whole machine's)


def _parse(key: str) -> tuple[str, str, set[str]] | None:
    parts = key.split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return None
    return parts[0], parts[1], {unit for unit in parts[2].split(",") if unit}


def _machine() -> str:
    try:
        boot_id = BOOT_ID.read_text().strip()
    except OSError:
        boot_id = ""
    return (boot_id or socket.gethostname()).replace(":", "-")
