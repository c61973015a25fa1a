"""Structured output of the LLM client (trainer/llm/client.py): a request's `response_format` (a pydantic model
or a JSON schema) as the server's json_schema parameter or, where a server lacks it, a prompted instruction;
each answer checked against the schema (`validate_output`: the parsed value, or why it is not the schema)."""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel


@functools.lru_cache(maxsize=64)
def model_schema(model_cls: type[BaseModel]) -> dict[str, Any]:
    """A pydantic model's JSON schema, built once per class (it costs milliseconds per call)."""
    return model_cls.model_json_schema()


_VALIDATORS: dict[str, Any] = {}


def schema_validator(schema: dict[str, Any]):
    """A compiled jsonschema validator per schema (checking the schema itself once, not per answer)."""
    key = json.dumps(schema, sort_keys=True)
    validator = _VALIDATORS.get(key)
    if validator is None:
        import jsonschema

        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        validator = _VALIDATORS[key] = cls(schema)
    return validator


def response_format_parts(response_format: Any) -> tuple[str, dict[str, Any] | None, Any]:
    """-> (name, JSON schema or None for json_object, validator) from a pydantic class / schema / OpenAI dict."""
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        return response_format.__name__, model_schema(response_format), response_format
    if isinstance(response_format, dict):
        if response_format.get("type") == "json_schema":
            js = response_format.get("json_schema") or {}
            return js.get("name", "output"), js.get("schema") or {}, None
        if response_format.get("type") == "json_object":
            return "output", None, None
        return "output", response_format, None
    raise TypeError(f"response_format must be a pydantic model class or a dict, not {type(response_format)}")


def validate_output(text: str, schema: dict[str, Any] | None, model_cls: Any) -> tuple[Any, str | None]:
    body = text.strip()
    if body.startswith("```"):  # a fenced block from a model without constrained decoding
        body = body.strip("`")
        if body.startswith("json"):
            body = body[4:]
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} at char {exc.pos}"
    if model_cls is not None:
        try:
            return model_cls.model_validate(obj).model_dump(mode="json"), None
        except Exception as exc:  # pydantic.ValidationError
            return None, f"schema: {str(exc).splitlines()[0]}"
    if schema:
        try:
            schema_validator(schema).validate(obj)
        except ImportError:
            pass
        except Exception as exc:  # jsonschema.ValidationError
            return None, f"schema: {getattr(exc, 'message', str(exc))}"
    return obj, None


def schema_instruction(schema: dict[str, Any] | None) -> str:
    if schema is None:
        return "Answer with one JSON object only, no other text."
    return "Answer with one JSON object only, no other text, that satisfies this JSON schema:\n" + json.dumps(
        schema, sort_keys=True
    )


def structured_request(
    req: dict[str, Any], response_format: Any, constrained: bool
) -> tuple[dict[str, Any] | None, Any, str | None]:
    """(schema, model class, how the answer is structured) of a request's `response_format`; with `constrained`
    (the endpoint does constrained decoding, as far as is known) sets the server's json_schema parameter in
    `req` ("json_schema"), else the request is to be prompted instead (None here, "prompted" once sent)."""
    if response_format is None:
        return None, None, None
    name, schema, model_cls = response_format_parts(response_format)
    if not constrained:
        return schema, model_cls, None
    if schema is None:
        req["response_format"] = {"type": "json_object"}
    else:
        req["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name[:64], "schema": schema},
        }
    return schema, model_cls, "json_schema"
