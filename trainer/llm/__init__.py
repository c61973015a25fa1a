"""The policy side's LLM access: the OpenAI-compatible client (`client.LLMClient`), the managed vLLM service
(`service`, its own venv) and behaviour-logprob rescoring (`rescore`)."""

from trainer.llm.client import LLMClient

__all__ = ["LLMClient"]
