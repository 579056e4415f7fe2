"""What a worker says it computes on (``WorkerInfo.device_key``), and when two workers' keys share a device."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from tandem.device_key import device_key, shares_device


def test_a_cpu_key_names_this_machine_and_the_process_s_cpus():
    kind, machine, units = device_key(torch.device("cpu")).split(":", 2)
    assert kind == "cpu" and machine
    assert units.split(",") == [str(cpu) for cpu in sorted(os.sched_getaffinity(0))]


def test_two_processes_on_this_machine_share_its_cpu_unless_pinned_apart():
    """As a draft worker beside its target under `tandem up`: another process's key shares this one's."""
    code = "import torch; from tandem.device_key import device_key; print(device_key(torch.device('cpu')))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    mine = device_key(torch.device("cpu"))
    assert other == mine and shares_device(mine, other)
    kind, machine, _ = mine.split(":", 2)
    assert not shares_device(f"{kind}:{machine}:0,1", f"{kind}:{machine}:2,3")  # pinned to other cores
    assert shares_device(f"{kind}:{machine}:0,1", f"{kind}:{machine}:1,2")


def test_keys_of_other_machines_kinds_or_none_share_nothing():
    assert not shares_device("cpu:host-a:0,1", "cpu:host-b:0,1")  # another node
    assert not shares_device("cpu:host-a:0", "cuda:host-a:0")  # a GPU beside the CPU
    assert shares_device("cuda:host-a:GPU-1234", "cuda:host-a:GPU-1234")
    assert not shares_device("cuda:host-a:GPU-1234", "cuda:host-a:GPU-5678")  # two GPUs of one node
    assert not shares_device("", "cpu:host-a:0")  # a worker that does not say (older) is taken to have its own
    assert not shares_device("garbage", "garbage")
