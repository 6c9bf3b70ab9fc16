"""Code that runs inside vLLM's worker processes (their own environment): this folder goes on the
``PYTHONPATH`` of the servers turnrl starts, so ``turnrl_vllm_worker`` imports there without turnrl."""

from pathlib import Path

WORKER_PATH = Path(__file__).resolve().parent
WORKER_EXTENSION = "turnrl_vllm_worker.TurnrlWorker"
