"""Warm-ups for ``env.preload`` ("module:function" entries are called once in the fork server, after
its imports): what a client does lazily on its first use, done once instead of once per run."""

from __future__ import annotations


def openai() -> None:
    """Make and drop an openai SDK client: its HTTP stack and chat resources import on first use
    (~55 ms of each run's CPU otherwise)."""
    import openai as sdk

    client = sdk.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="warm-up", max_retries=0)
    _ = client.chat.completions, client.responses
    client.close()


def anthropic() -> None:
    """Make and drop an anthropic SDK client (its messages resource imports on first use)."""
    import anthropic as sdk

    client = sdk.Anthropic(base_url="http://127.0.0.1:9", api_key="warm-up", max_retries=0)
    _ = client.messages
    client.close()
