"""The embedded transformers engine (``HFEngine``), split by job: the facade (``engine``), the
worker thread's scheduler, the batched KV cache, the per-session prefix cache, multimodal
positions and sampling."""

from turnrl.engines.hf.engine import HFEngine
from turnrl.engines.hf.sampling import sample_token

__all__ = ["HFEngine", "sample_token"]
