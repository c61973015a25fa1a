"""What the pipeline's LLM stages (IAPO annotation, TCPO counterfactuals) build and read: requests, results,
errors and the client's settings (`pipeline.llm.types`). Sending them is the trainer floor's job
(`trainer.llm.client.LLMClient`, over the `openai` SDK); vLLM runs as a separate service in its own venv
(`trainer.llm.service`) and is never imported."""

from pipeline.llm.types import (
    ChatResult,
    Choice,
    CompletionResult,
    LLMError,
    LLMRequest,
    LLMSettings,
)

__all__ = ["ChatResult", "Choice", "CompletionResult", "LLMError", "LLMRequest", "LLMSettings"]
