"""Typed run configuration: one class per part, loaded from YAML with dotted ``--set`` overrides.

Each section is defined once. ``sampling`` is the engine's own ``SamplingParams`` and
``limits`` the loop's own ``Limits``; the engine section is a union keyed on ``kind``, each
kind with only its own keys; ``TrainConfig`` (in ``turnrl.train.config``) extends the shared
run sections. ``turnrl config show CONFIG`` prints a resolved config and every field's doc.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from turnrl.support.cache import cache_dir
from turnrl.support.imports import add_search_path
from turnrl.types import Limits, SamplingParams


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


class Strict(BaseModel):
    """A config section: unknown keys are errors, and every field has a doc."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


# ---- Ray: engines and env workers as actors ----------------------------------------------


class RayEnvConfig(Strict):
    """Run every env in a pool of Ray worker actors (``pip install 'turnrl[ray]'``); off: in-process."""

    enabled: bool = False
    """False: envs run in the driver's event loop, and Ray is never imported."""
    address: str | None = None
    """None: this process's Ray or a new local one; "auto" / ray://...: a cluster."""
    num_workers: int = Field(2, ge=1)
    """Worker actors (one process each); envs go to the least loaded one."""
    num_cpus_per_worker: float = Field(1.0, ge=0)
    """CPUs each worker reserves from the cluster."""
    env_threads: bool = True
    """Each env on its own thread and event loop: a blocking env stalls only itself."""
    close_timeout_s: float = Field(30.0, gt=0)
    """Longest wait for an env's close before the driver moves on."""
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    """The workers' Ray runtime_env (pip, env_vars)."""


class RayEngineConfig(Strict):
    """Run the engine as Ray actors, and take engines registered from other nodes; off: in-process."""

    enabled: bool = False
    """False: the engine runs in the driver (or is reached by URL); Ray is never imported."""
    address: str | None = None
    """None: this process's Ray or a new local one; "auto" / ray://...: a cluster."""
    replicas: int = Field(1, ge=0)
    """Engine actors this driver starts (0: only engines in the registry)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs each engine actor reserves."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs each engine actor reserves (set the engine's device to cuda)."""
    registry: str | None = None
    """A named registry actor: also use the engines other nodes register there."""
    namespace: str = "turnrl"
    """The Ray namespace of the registry."""
    min_engines: int = Field(1, ge=1)
    """Registry: engines to wait for before the rollout starts."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for engine actors / min_engines."""
    refresh_s: float = Field(5.0, gt=0)
    """Registry: how often the driver re-reads the engine list."""
    health_interval_s: float = Field(5.0, gt=0)
    """Registry: how often it checks each engine (set when it is created)."""
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    """The engine actors' Ray runtime_env."""


# ---- engines: a union keyed on kind --------------------------------------------------------


class HFEngineConfig(Strict):
    """The embedded transformers engine: continuous batching in this process (CPU or GPU)."""

    kind: Literal["hf"] = "hf"
    """hf: the embedded engine (the default)."""
    max_batch_size: int = Field(32, ge=1)
    """Sequences decoded together."""
    max_prefill_tokens: int = Field(8192, ge=1)
    """Prompt tokens prefilled in one forward pass; longer prefills are split."""
    prefix_cache_tokens: int = Field(32768, ge=0)
    """Tokens of KV kept between a trajectory's turns (0: re-prefill every turn)."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads for the engine (None: torch's default, one per core). On a machine where other
    processes keep cores busy, fewer: two threads on one free core wait on each other every step."""
    packed_weights: bool | None = None
    """Serve linear layers from oneDNN-packed weights (None: on CPU in float32/bfloat16)."""
    cuda_graphs: bool | None = None
    """Replay decode steps from CUDA graphs over a KV cache reserved for max_batch_size rows (None: on
    for Llama, Mistral, Qwen2 and Qwen3 text models on a GPU; false: plain decode steps)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights' dtype."""
    device: str = "cpu"
    """cpu, cuda, cuda:1..."""
    ray: RayEngineConfig = Field(default_factory=RayEngineConfig)
    """Engine actors on Ray; off: in this process."""


class BalancerConfig(Strict):
    """How trajectories are spread over several servers."""

    max_sticky_turns: int = Field(32, ge=1)
    """Turns a trajectory stays on one server (its prefix cache)."""
    load_factor: float = Field(2.0, ge=1)
    """Move a trajectory off a server this much busier than the least busy one."""
    cooloff_s: float = Field(30.0, ge=0)
    """How long a failed server is left out."""


class _ClientConfig(Strict):
    api_key_env: str | None = None
    """Name of the environment variable holding the API key."""
    timeout_s: float = Field(300.0, gt=0)
    """One request."""
    max_retries: int = Field(3, ge=0)
    """Retries of connection errors, 5xx and timeouts."""
    retry_budget_s: float = Field(600.0, gt=0)
    """Total seconds of retrying for one request."""
    balancer: BalancerConfig = Field(default_factory=BalancerConfig)
    """Several servers: how trajectories are spread over them."""


class _ServerEngineConfig(_ClientConfig):
    urls: list[str] = Field(min_length=1)
    """The servers' base URLs; several go behind a load balancer."""
    ray: RayEngineConfig = Field(default_factory=RayEngineConfig)
    """Register the servers in a Ray registry that other nodes share; off: reached by URL only."""


class OpenAIEngineConfig(_ServerEngineConfig):
    """OpenAI-compatible completions servers with token ids in and out (vLLM, SGLang, llama.cpp)."""

    kind: Literal["openai"]
    """openai: completions servers reached by URL."""
    dialect: Literal["vllm", "sglang", "llamacpp"] = "vllm"
    """Which server speaks (each asks for token ids and logprobs its own way)."""
    served_model: str | None = None
    """The servers' "model" field (None: the run's model)."""


class SGLangEngineConfig(_ServerEngineConfig):
    """SGLang servers through their native ``/generate`` endpoint."""

    kind: Literal["sglang"]
    """sglang: SGLang's native API, reached by URL."""


class VLLMEngineConfig(_ClientConfig):
    """vLLM: servers turnrl starts and stops (default), running servers (``urls``), or in process."""

    kind: Literal["vllm"]
    """vllm: vLLM servers, token ids in and out, weights updated in place."""
    urls: list[str] = Field(default_factory=list)
    """Running vLLM servers (with VLLM_SERVER_DEV_MODE=1 for weight updates); empty: turnrl starts them."""
    servers: int = Field(1, ge=1)
    """How many servers turnrl starts on loopback ports (without urls)."""
    max_model_len: int = Field(4096, ge=16)
    """Context length of a started server (prompt + response tokens)."""
    dtype: str = "float32"
    """Weights' dtype in a started server (bfloat16 on GPUs for speed; float32 matches a CPU trainer)."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV cache of a started CPU server, GiB (VLLM_CPU_KVCACHE_SPACE; GPU builds size their own)."""
    server_args: dict[str, Any] = Field(default_factory=dict)
    """More flags for a started server, e.g. {max_num_seqs: 64, gpu_memory_utilization: 0.5}."""
    python: str | None = None
    """The Python of vLLM's own environment (None: $TURNRL_VLLM_PYTHON or scripts/install_vllm.sh's)."""
    start_timeout_s: float = Field(900.0, gt=0)
    """How long started servers may take to become healthy."""
    weights_dir: str | None = None
    """Where weight updates are written for the servers to load (a folder they can read; None: a temp one)."""
    refresh_tied_weights: bool | None = None
    """After each reload, refresh a tied output layer's packed copy (vLLM's CPU build keeps it stale)
    through turnrl's worker extension; None: on for servers turnrl starts, off for urls."""
    weight_sync: Literal["auto", "collective", "file"] = "auto"
    """How a step's weights reach the servers. ``collective``: broadcast in buckets to each server's
    workers over a process group with this process (gloo for CPU weights, NCCL for GPU ones;
    nothing touches a disk; the servers run turnrl's worker extension). ``file``: written as
    safetensors to ``weights_dir`` and loaded by each server (servers on other machines that cannot
    reach this one). ``auto``: collective for servers turnrl starts when the trainer's weights are
    on a GPU, else file (on a CPU, a file in /dev/shm is faster than gloo: BENCHMARKS.md)."""
    weight_sync_host: str = "127.0.0.1"
    """With ``collective``: the address at which the servers' workers reach this process's group."""
    request_params: dict[str, Any] = Field(default_factory=dict)
    """More fields for every request, e.g. {repetition_penalty: 1.1, min_p: 0.05} (turnrl's own win)."""
    keep_in_flight: bool = False
    """A weight push freezes the turns in flight and they go on in the same requests under the new
    weights, their KV cache kept (nothing is run again; as PipelineRL's in-flight updates), each token
    stamped by the server with the version that sampled it; false: they are aborted and go on from
    their last token in new requests, their context run again under the new weights. Servers need
    --enable-scale-out (those turnrl starts get it); not in process, not under torchrun."""
    in_process: bool = False
    """Run vLLM's AsyncLLM inside this process instead (vllm importable here; engine_args apply)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """In process: vLLM's AsyncEngineArgs (gpu_memory_utilization, tensor_parallel_size...)."""
    ray: RayEngineConfig = Field(default_factory=RayEngineConfig)
    """Engine actors on Ray, each running vLLM in process; off: in this process."""

    def sync_way(self, *, on_gpu: bool) -> Literal["file", "collective"]:
        """How weights reach the servers from a trainer whose weights are on a GPU (``on_gpu``) or
        not: ``weight_sync``, ``auto`` being collective (NCCL) for servers turnrl starts when the
        weights are on a GPU, and file otherwise (on a CPU a file in /dev/shm is the faster way:
        BENCHMARKS.md)."""
        if self.weight_sync != "auto":
            return self.weight_sync
        return "collective" if on_gpu and not self.urls else "file"

    @model_validator(mode="after")
    def _one_mode(self) -> VLLMEngineConfig:
        if self.in_process and self.urls:
            raise ValueError("engine.in_process and engine.urls exclude each other")
        if self.in_process and self.keep_in_flight:
            raise ValueError("engine.keep_in_flight needs vLLM servers, not engine.in_process")
        if self.ray.enabled and not self.in_process:
            raise ValueError(
                "engine.ray with kind vllm runs vLLM inside each actor: set engine.in_process: true"
            )
        return self


class ScriptedEngineConfig(Strict):
    """No model: an env author's policy function plays, to drive an env from the CLI before any
    model can. It is called per turn as ``policy(messages, images, sample)`` and returns the
    turn's text (or a ``ScriptedReply``); the text is tokenized with the run's model tokenizer."""

    kind: Literal["scripted"]
    """scripted: a policy function instead of a model."""
    policy: str
    """"module:function" (sync or async) returning the model turn's text."""
    logprob: float = Field(-0.5, le=0)
    """The logprob recorded for every scripted token."""


def _engine_kind(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("kind", "hf"))
    return str(getattr(value, "kind", "hf"))


EngineConfig = Annotated[
    Annotated[HFEngineConfig, Tag("hf")]
    | Annotated[OpenAIEngineConfig, Tag("openai")]
    | Annotated[SGLangEngineConfig, Tag("sglang")]
    | Annotated[VLLMEngineConfig, Tag("vllm")]
    | Annotated[ScriptedEngineConfig, Tag("scripted")],
    Discriminator(_engine_kind),
]
"""The engine section: ``kind`` picks the class, and so which keys are allowed."""

AnyEngineConfig = HFEngineConfig | OpenAIEngineConfig | SGLangEngineConfig | VLLMEngineConfig
"""The engines that run a model (every kind but scripted)."""
ENGINE_KINDS = ("hf", "openai", "sglang", "vllm", "scripted")


# ---- the other parts -----------------------------------------------------------------------


class ChatConfig(Strict):
    """Chat template options."""

    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the chat template, e.g. {enable_thinking: false}."""
    check: Literal["strict", "ignore_strippable", "disable"] = "strict"
    """End-of-trajectory sanity check against a full re-render."""
    inference_contexts: bool = False
    """Record each model turn's context as a chat server renders it (history re-rendered: past
    reasoning dropped where the template drops it) where it differs from the exact prefix, as
    Turn.context_ids; algorithm.samples: inference trains on them (and turns this on)."""


class EnvRoute(Strict):
    """One more env that data rows may name (``env: KEY`` in a row)."""

    name: str
    """A registered env or "module:Class"."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to its constructor after the sample."""


class EnvConfig(Strict):
    """The environment: a registered name or ``module:Class``, and its constructor kwargs."""

    kind: Literal["env"] = "env"
    """An env turnrl runs turn by turn (``harness``: an agent that already exists, run as a process)."""
    name: str
    """A registered env (guess_number, math_tools...) or "module:Class"."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the env's constructor after the sample."""
    routes: dict[str, EnvRoute] = Field(default_factory=dict)
    """Per-row envs: a row with ``env: KEY`` plays in routes[KEY] (a row may also name an env
    directly, built without kwargs); rows without ``env`` play in ``name``."""
    ray: RayEnvConfig = Field(default_factory=RayEnvConfig)
    """Env workers on Ray; off: in-process."""


class SandboxConfig(Strict):
    """The sandbox every process of a harness run runs in (bubblewrap): the system read-only, the
    run's folder the only place it may write, a private /tmp and home, its own PID namespace (it
    sees no other process, and all of it dies with the run), and on the network its gateway only.
    With ``runtime: podman`` each process runs in a container of the task's image instead, with the
    same folder, network and limits."""

    runtime: Literal["bubblewrap", "podman"] = "bubblewrap"
    """bubblewrap: this machine's system, read-only (a task's Dockerfile may only name a base image,
    a working directory, files and variables); podman: a container of the image built from the
    task's whole Dockerfile (``RUN`` steps included), or of ``image`` for a row that is no task."""
    image: str | None = None
    """podman: the image of runs whose row names no task with a Dockerfile or an image of its own."""
    podman: list[str] = Field(default_factory=lambda: ["podman"])
    """podman: the command, with podman's own options (``[podman, --runtime, /path/to/runc]``)."""
    memory_mb: int = Field(4096, ge=64)
    """Private writable memory of each process (RLIMIT_DATA): past it, allocations fail."""
    max_processes: int = Field(256, ge=8)
    """Processes and threads of the run at once (a pids cgroup where turnrl may make one, else
    RLIMIT_NPROC): a fork bomb stops here."""
    file_size_mb: int = Field(1024, ge=1)
    """The largest file a process may write (RLIMIT_FSIZE)."""
    network: Literal["gateway", "host"] = "gateway"
    """gateway: a network of its own where 127.0.0.1 at the gateway's port reaches the run's
    gateway session and nothing else exists; host: the machine's network (anything the user can
    reach, other services on loopback included)."""
    read_only: list[str] = Field(default_factory=list)
    """More host paths shown read-only at the same place (an agent's install outside the Python
    environment and the system folders, a data set); ``~`` is the user's home and ``{cache}``
    turnrl's cache folder (where ``scripts/install_agents.sh`` puts the agent CLIs)."""

    @field_validator("read_only")
    @classmethod
    def _expand(cls, paths: list[str]) -> list[str]:
        return [os.path.expanduser(path.replace("{cache}", str(cache_dir()))) for path in paths]


class HarnessConfig(Strict):
    """An agent that already exists, run once per sample and group member as a process of its own,
    its model calls served and recorded by the gateway (``env: {kind: harness, ...}``)."""

    kind: Literal["harness"]
    """An agent harness (``env``: an env turnrl runs turn by turn)."""
    command: list[str] | str
    """The agent: an argv (``[python, agent.py, "{prompt}"]``: ``{prompt}`` is the row's last user
    message, ``python`` the interpreter turnrl runs in, an argument naming an existing file is made
    absolute), or "module:function", called as ``fn(sample, folder)`` in a process of its own. It
    runs in the run's folder, with the gateway's URL and the session's key in OPENAI_BASE_URL,
    OPENAI_API_KEY, ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY, and the row in the JSON file
    TURNRL_SAMPLE."""
    reward: str
    """"module:function": ``fn(sample, result) -> float | list[float] | None`` once the agent ended
    (``turnrl.harness.HarnessResult``: the session's branches, final messages, exit code, output
    tails, the folder). A list gives each branch its own reward; None leaves the run out of its
    group's baseline and of training (counted as train/excluded/reward_none)."""
    folder: str | None = None
    """A folder copied as each run's working folder (none: an empty one)."""
    setup: str | None = None
    """"module:function": ``fn(sample, folder)`` prepares a run's folder (after the copy)."""
    timeout_s: float = Field(300.0, gt=0)
    """A run still going after this long is killed with its whole process group (agent_timeout)."""
    scored_exit_codes: list[int] = Field(default_factory=lambda: [0])
    """Exit codes after which a run is scored as one that ended (its reward runs, its branches are
    trained: agent_done). Another code is a crash (agent_error), left out of training. An agent
    that exits non-zero because of what the model said is the model's failure, which training
    should see: ``codex exec`` exits 1 when a reply is cut off at ``max_tokens`` (list ``[0, 1]``)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the agent, on top of this process's own; ``{openai_base_url}``,
    ``{anthropic_base_url}``, ``{api_key}`` (the run's session), ``{folder}`` (the run's folder) and
    ``{cache}`` (turnrl's cache folder) are filled in."""
    max_calls: int = Field(256, ge=1)
    """A session's model calls: the next one is refused (HTTP 400), and the run ends as token_budget."""
    max_session_tokens: int = Field(32768, ge=16)
    """A branch's tokens never exceed this: a call that would is refused (context length)."""
    tool_parser: str | None = None
    """The tool-call format replies are parsed with (hermes, llama3_json...; None: the one the
    model's chat template names, if any): for a model taught a format its template does not render."""
    sandbox: SandboxConfig | Literal["none"] = Field(default_factory=SandboxConfig)
    """Where the agent, everything it starts and the reward's commands run: a bubblewrap sandbox
    (the default; ``apt-get install bubblewrap``), or "none": as plain processes of the user, which
    can write anywhere the user can and reach other runs (a warning says so)."""
    reinforce: Literal["all", "last"] = "all"
    """Which branches of a session are trained: every one, or only the last one started."""
    skip_system: list[str] = Field(default_factory=list)
    """Regexes: a branch whose system prompt matches one is not trained (auxiliary calls such as
    title generation), counted as train/excluded/not_reinforced."""
    keep_folders: bool = False
    """Keep each run's folder (under OUT/harness/) instead of removing it when the run is scored."""
    preload: list[str] = Field(default_factory=list)
    """Modules (``[openai]``) imported once by a fork server that then forks each run of a Python
    agent (an argv ``[python, agent.py, ...]`` or ``[python, -m, module, ...]``, a console script of
    this interpreter, or "module:function"), so that no run pays their import time (the openai SDK:
    ~0.7 s of CPU a run). A forked run has its own process group, folder, variables, output files
    and exit code, as a new process would. The imports see turnrl's variables and the fixed ones of
    ``env.env``, not a run's own (its session URL), so a preloaded module must not read those when it
    is imported. A "module:function" entry is called once after the imports, a warm-up
    (``turnrl.harness.warm:openai`` makes and drops an openai client, whose HTTP stack imports on
    first use). Other commands start as new processes. Empty: every run is a new process.
    With ``env.sandbox`` on, the fork server runs in a sandbox and each forked run enters one of its
    own (``turnrl.harness.namespaces``): it sees and may do what a run started as a new process
    may."""


def _env_kind(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("kind", "env"))
    return str(getattr(value, "kind", "env"))


AnyEnvConfig = Annotated[
    Annotated[EnvConfig, Tag("env")] | Annotated[HarnessConfig, Tag("harness")],
    Discriminator(_env_kind),
]
"""The env section: ``kind`` picks an env turnrl runs (the default) or an agent harness."""


class DataConfig(Strict):
    """Where samples come from: a file or dataset folder, or a generator (env data or module:fn)."""

    path: str | None = None
    """Rows with at least a "prompt": JSONL, a JSON list, Parquet, or a Hugging Face dataset saved
    with save_to_disk (a folder)."""
    split: str = "train"
    """The split of a saved DatasetDict."""
    generator: str | None = None
    """"module:function" returning rows; default: the env's own data."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to the generator (or to the env's own data)."""
    limit: int | None = Field(None, ge=1)
    """Use the first N samples."""


JUDGE_RUBRIC = (
    "Grade the assistant's work on the task below.\n\nTask:\n{question}\n\n"
    "Reference answer (may be empty):\n{reference}\n\nThe assistant's conversation:\n{transcript}\n\n"
    "Give a score from 0 (wrong or useless) to 10 (correct and complete). End with a line 'Score: N'."
)
JUDGE_RANK_RUBRIC = (
    "Compare the assistant's attempts at the task below.\n\nTask:\n{question}\n\n"
    "Reference answer (may be empty):\n{reference}\n\n{attempts}\n\n"
    "Score every attempt from 0 (wrong) to 10 (best), relative to each other. "
    "End with a line 'Scores: [s1, s2, ...]' with one number per attempt, in order."
)


class JudgeConfig(Strict):
    """An LLM judge as a data source's reward: a second model, not trained, on any engine kind or an
    OpenAI-compatible chat endpoint. ``score`` grades each trajectory; ``rank`` grades a whole
    GRPO group in one call (RULER-style). Replies are cached by content; a reply without a score
    is a reward error (reported, reward 0), not a crash."""

    model: str | None = None
    """The judge model (shipped name, folder, hub id) for a token engine; an endpoint's model name."""
    engine: dict[str, Any] = Field(default_factory=lambda: {"kind": "hf"})
    """The judge's engine section (any kind; default: the embedded engine)."""
    base_url: str | None = None
    """An OpenAI-compatible chat endpoint (…/v1) instead of a token engine."""
    api_key_env: str | None = None
    """Environment variable holding the endpoint's API key."""
    sampling: dict[str, Any] = Field(default_factory=lambda: {"temperature": 0.0, "max_tokens": 256})
    """The judge's sampling."""
    mode: Literal["score", "rank"] = "score"
    """score: one call per trajectory; rank: one call per group."""
    rubric: str | None = None
    """The prompt, with {question}, {reference}, {transcript} (score) or {attempts} (rank)."""
    max_score: float = Field(10.0, gt=0)
    """The scale the judge is asked for; rewards are score / max_score."""
    max_concurrency: int = Field(8, ge=1)
    """Judge calls in flight at once."""
    cache: bool = True
    """Reuse the reply to a prompt already judged."""


class RolloutConfig(Strict):
    """How many trajectories per prompt, and how many at once."""

    group_size: int = Field(1, ge=1)
    """Trajectories per prompt (a GRPO group)."""
    concurrency: int = Field(32, ge=1)
    """Trajectories in flight."""
    fail_fraction: float = Field(0.5, ge=0.0, le=1.0)
    """A rollout, training step or evaluation where more than this share of the trajectories
    ended in engine_error, env_error, internal_error, agent_error or agent_timeout stops the run
    (exit 1): the infrastructure is broken, and their zero rewards say nothing of the model.
    1: never stop."""


class CollectConfig(RolloutConfig):
    """A ``turnrl rollout`` run's rollout section: the shared one, plus per-turn logging."""

    log_turns: bool = False
    """Also write every turn to turns.jsonl as it happens."""


class RunSections(Strict):
    """The sections every run shares (``turnrl rollout``, ``turnrl train``, the integrations)."""

    model: str
    """HF id in the local cache, a local folder, or a shipped name: tiny-qwen3, smollm2-135m,
    smollm2-135m-play (SmolLM2 warm-started on the example envs, built once on first use)."""
    env: AnyEnvConfig
    """The environment, or an agent harness (``kind: harness``)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The prompts."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """The engine that generates."""
    chat: ChatConfig = Field(default_factory=ChatConfig)
    """Chat template options."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Per-turn sampling (each request's seed derives from the run's seed)."""
    limits: Limits = Field(default_factory=Limits)
    """When trajectories stop."""
    rewards: dict[str, str] = Field(default_factory=dict)
    """data_source -> "module:function" scoring one trajectory: fn(RewardContext) -> float."""
    group_rewards: dict[str, str] = Field(default_factory=dict)
    """data_source -> "module:function" scoring a whole group: fn(list[RewardContext]) -> list[float]."""
    judges: dict[str, JudgeConfig] = Field(default_factory=dict)
    """data_source -> an LLM judge as its reward (per trajectory, or a group at once)."""
    seed: int = 0
    """The run's seed: sampling, env and prompt-order seeds derive from it."""

    @field_validator("sampling")
    @classmethod
    def _one_seed(cls, sampling: SamplingParams) -> SamplingParams:
        if sampling.seed is not None:
            raise ValueError("set the run's top-level seed instead (every request's seed derives from it)")
        if sampling.max_tokens < 1:
            raise ValueError(f"max_tokens is {sampling.max_tokens}: a turn must be allowed at least 1 token")
        return sampling


class RunConfig(RunSections):
    """A whole ``turnrl rollout`` run."""

    rollout: CollectConfig = Field(default_factory=CollectConfig)
    """Group size, concurrency, per-turn logging."""
    output_dir: str = "runs/rollout"
    """Where trajectories.jsonl, summary.json and config.yaml go."""


# ---- loading -------------------------------------------------------------------------------


def _parse_value(raw: str) -> Any:
    """A --set value: YAML scalars and lists (``3``, ``true``, ``[a, b]``), else the string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict. Setting a section's ``kind`` to another
    kind (``engine.kind=hf`` on a scripted engine) replaces the section with the new kind's
    defaults, since the old kind's keys mean nothing to it; kind switches apply first, so the
    other overrides of the same command land on the new section."""
    split = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        split.append((key, raw))
    for key, raw in sorted(split, key=lambda kv: kv[0].split(".")[-1] != "kind"):  # stable: kinds first
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        value = _parse_value(raw)
        if parts[-1] == "kind" and len(parts) > 1 and node.get("kind") not in (None, value):
            node.clear()
        node[parts[-1]] = value
    return data


def first_error(exc: ValidationError, data: Any) -> str:
    """One line naming the first invalid key as the user wrote it (``data``: the input validated)
    and how many other keys are invalid."""
    errors = exc.errors()
    wheres = [_where(e["loc"], data) for e in errors]
    err, where = errors[0], wheres[0]
    others = len({w for w in wheres if not _related(w, where)})
    more = f" (+{others} more)" if others else ""
    shown = where or "config"
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"unknown config key {shown!r}{more}"
    if err["type"] == "missing":
        return f"missing config key {shown!r}{more}"
    if err["type"] == "union_tag_invalid":
        kinds = str((err.get("ctx") or {}).get("expected_tags", ", ".join(ENGINE_KINDS))).replace("'", "")
        return f"config key {shown + '.kind'!r}: must be one of {kinds}{more}"
    if not where:  # a check across keys: its message names them
        return f"{err['msg'].removeprefix('Value error, ')}{more}"
    said = _union_message([e for e, w in zip(errors, wheres, strict=True) if w == where])
    return f"config key {shown!r}: {said}{more}"


def _where(loc: tuple[int | str, ...], data: Any) -> str:
    """``loc`` as the key path the user wrote (``a.b[0].c``). With the input at hand, a part of
    ``loc`` is kept when it indexes the input there (or names the key a mapping lacks, at the end):
    what is left out is pydantic's, a union's tag (``harness``) or member (``list[str]``)."""
    parts: list[str] = []
    node = data
    for i, part in enumerate(loc):
        if isinstance(node, dict | list) and _indexes(node, part):
            node, keep = node[part], True  # type: ignore[index]
        elif isinstance(node, BaseModel) and isinstance(part, str) and part in type(node).model_fields:
            node, keep = getattr(node, part), True  # a section given as a model, not a mapping
        else:
            keep = i == len(loc) - 1 and isinstance(node, dict) and isinstance(part, str)
        if keep:
            parts.append(f"[{part}]" if isinstance(part, int) else f".{part}")
    return "".join(parts).removeprefix(".")


def _indexes(node: dict[Any, Any] | list[Any], part: int | str) -> bool:
    """Whether ``node[part]`` is there."""
    if isinstance(node, dict):
        return part in node
    return isinstance(part, int) and 0 <= part < len(node)


def _related(a: str, b: str) -> bool:
    """Whether two key paths are one key, or one holds the other (a union's members' errors)."""
    return a == b or a.startswith((b + ".", b + "[")) or b.startswith((a + ".", a + "["))


def _union_message(errors: list[Any]) -> str:
    """The message of one key's errors: the members of a union each say what they wanted."""
    messages = list(dict.fromkeys(str(e["msg"]) for e in errors))
    wanted = "Input should be "
    if len(messages) > 1 and all(m.startswith(wanted) for m in messages):
        return wanted + ", or ".join(m.removeprefix(wanted) for m in messages)
    return messages[0]


M = TypeVar("M", bound=BaseModel)


def read_yaml_mapping(path: str | os.PathLike[str], error: type[ValueError] = ConfigError) -> dict[str, Any]:
    """A YAML file's top-level mapping; ``error`` with a one-line reason when it has none."""
    file = Path(path)
    if not file.is_file():
        raise error(f"config file not found: {file}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise error(f"config file {file} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"config file {file} must hold a mapping at the top")
    return data


def validate(model: type[M], data: dict[str, Any], context: dict[str, Any] | None = None) -> M:
    """``data`` as ``model`` (``context`` for its validators); ConfigError with one line naming the
    first bad key."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(first_error(exc, data)) from None


def load_model_config(
    path: str | Path,
    model: type[M],
    overrides: list[str] | None = None,
    context: dict[str, Any] | None = None,
) -> M:
    """Read a YAML config, apply ``--set`` overrides, validate it as ``model``. The config's folder
    and the working directory become importable, for its ``module:Class`` paths."""
    data = read_yaml_mapping(path)
    add_search_path(Path(path).parent, Path.cwd())
    return validate(model, apply_overrides(data, overrides or []), context)


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a rollout config, apply overrides, validate."""
    return load_model_config(path, RunConfig, overrides)


def dump_config(config: BaseModel) -> dict[str, Any]:
    """The resolved config as plain YAML-ready data (tuples as lists)."""
    return yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)) or {}
