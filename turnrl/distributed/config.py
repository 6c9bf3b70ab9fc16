"""The config switch for env workers on Ray. Importing it never imports Ray."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RayEnvConfig(BaseModel):
    """Run every env in a pool of Ray worker actors (``pip install 'turnrl[ray]'``); off: in-process."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False  # false: envs run in the driver's event loop, and Ray is never imported
    address: str | None = None  # None: this process's Ray or a new local one; "auto" / ray://...: a cluster
    num_workers: int = Field(2, ge=1)  # worker actors (one process each); envs go to the least loaded one
    num_cpus_per_worker: float = Field(1.0, ge=0)  # CPUs each worker reserves from the cluster
    env_threads: bool = True  # each env on its own thread + event loop: a blocking env stalls only itself
    close_timeout_s: float = Field(30.0, gt=0)  # longest wait for an env's close before the driver moves on
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # the workers' Ray runtime_env (pip, env_vars)
