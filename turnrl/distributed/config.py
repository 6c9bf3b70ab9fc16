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


class RayEngineConfig(BaseModel):
    """Run the engine as Ray actors, and take engines registered from other nodes; off: in-process."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = (
        False  # false: the engine runs in the driver (or is reached by URL); Ray is never imported
    )
    address: str | None = None  # None: this process's Ray or a new local one; "auto" / ray://...: a cluster
    replicas: int = Field(1, ge=0)  # engine actors this driver starts (0: only engines in the registry)
    num_cpus: float = Field(1.0, ge=0)  # CPUs each engine actor reserves
    num_gpus: float = Field(0.0, ge=0)  # GPUs each engine actor reserves (set engine.device: cuda)
    registry: str | None = None  # a named registry actor: also use the engines other nodes register there
    namespace: str = "turnrl"  # the Ray namespace of the registry
    min_engines: int = Field(1, ge=1)  # registry: engines to wait for before the rollout starts
    start_timeout_s: float = Field(300.0, gt=0)  # longest wait for engine actors / min_engines
    refresh_s: float = Field(5.0, gt=0)  # registry: how often the driver re-reads the engine list
    health_interval_s: float = Field(5.0, gt=0)  # registry: how often it checks each engine (set on creation)
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # the engine actors' Ray runtime_env
