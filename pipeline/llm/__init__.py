"""LLM access for every stage that needs a model (IAPO annotation, TCPO counterfactuals, rescoring).

All of it goes through one OpenAI-compatible client (`pipeline.llm.client.LLMClient`) talking to vLLM
servers (or any OpenAI-compatible endpoint); vLLM itself runs as a separate service in its own venv
(`pipeline.llm.service`) and is never imported here."""

from pipeline.llm.client import (
    ChatResult,
    Choice,
    CompletionResult,
    LLMClient,
    LLMError,
    LLMRequest,
    LLMSettings,
)

__all__ = ["ChatResult", "Choice", "CompletionResult", "LLMClient", "LLMError", "LLMRequest", "LLMSettings"]
