"""Faults on purpose: a loopback completions server, envs and tools that fail, and the fault suite
that runs a rollout under each of them (``python bench/faults.py``)."""

from fault_harness.envs import FaultyEnv, fault_tools
from fault_harness.server import Fault, FaultServer

__all__ = ["Fault", "FaultServer", "FaultyEnv", "fault_tools"]
