"""Readers: a file's text -> verbatim records (`SourceRecord`), one per JSONL line, JSON list entry or JSON
object member, each with its location; a record that cannot be parsed carries its error and goes to
quarantine on its own, without stopping the others."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from pipeline.ingest.records import MALFORMED_JSON, Reject, SourceRecord

# ---- readers: file text -> verbatim records ------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


TOO_DEEP = object()  # stands for a JSON value nested too deep to decode (`iter_json_object`)
_JSON_SYNTAX = re.compile(r'["\\\[\]{}]')


def skip_json_value(text: str, pos: int) -> int:
    """End of the JSON array/object starting at `pos`, by matching brackets outside strings (for a value too
    deep for the decoder: it is skipped, not parsed). ValueError when it does not end."""
    depth, in_string, i = 0, False, pos
    while True:
        m = _JSON_SYNTAX.search(text, i)
        if m is None:
            raise ValueError(f"unterminated JSON value at char {pos}")
        c, i = m.group(), m.end()
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i


def _malformed(source_file: str, location: str, raw: str, exc: Exception) -> SourceRecord:
    detail = "nested too deep to parse" if isinstance(exc, RecursionError) else str(exc)
    return SourceRecord(source_file, location, raw, error=Reject(MALFORMED_JSON, detail))


def read_jsonl(text: str, source_file: str) -> Iterator[SourceRecord]:
    """One record per non-blank line (location `line N`, 1-based)."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        location = f"line {lineno}"
        try:
            data = json.loads(line)
        except (ValueError, RecursionError) as exc:
            yield _malformed(source_file, location, line, exc)
            continue
        yield SourceRecord(source_file, location, line, data)


def iter_json_array(
    text: str, pos: int, source_file: str, path: str = ""
) -> Iterator[tuple[SourceRecord, int]]:
    """Items of the JSON array starting at `pos`, each with its verbatim text; yields (record, end)."""
    pos = _skip_ws(text, pos)
    if pos >= len(text) or text[pos] != "[":
        yield _malformed(source_file, path or "$", text[pos:], ValueError("expected a JSON array")), len(text)
        return
    pos = _skip_ws(text, pos + 1)
    index = 0
    if pos < len(text) and text[pos] == "]":
        yield from _after_array(text, pos + 1, source_file, path)
        return
    while pos < len(text):
        location = f"{path}[{index}]"
        try:
            data, end = _DECODER.raw_decode(text, pos)
        except RecursionError as exc:  # this record only: its end is found by its brackets
            try:
                end = skip_json_value(text, pos)
            except ValueError:
                yield _malformed(source_file, f"{path}[{index}:]", text[pos:], exc), len(text)
                return
            data = TOO_DEEP
        except ValueError as exc:
            # the rest of the array cannot be split reliably: quarantine it as one record
            yield _malformed(source_file, f"{path}[{index}:]", text[pos:], exc), len(text)
            return
        if data is TOO_DEEP:
            yield _malformed(source_file, location, text[pos:end], RecursionError()), end
        else:
            yield SourceRecord(source_file, location, text[pos:end], data), end
        pos = _skip_ws(text, end)
        index += 1
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            yield from _after_array(text, pos + 1, source_file, path)
            return
        yield (
            _malformed(source_file, f"{path}[{index}:]", text[pos:], ValueError("expected ',' or ']'")),
            len(text),
        )
        return
    # the text ended inside the array (a truncated file): what is missing is one quarantined record
    yield (
        _malformed(source_file, f"{path}[{index}:]", "", ValueError("the array is not closed (no ']')")),
        len(text),
    )


def _after_array(text: str, end: int, source_file: str, path: str) -> Iterator[tuple[SourceRecord, int]]:
    """Text after the array's closing bracket (a damaged file): one quarantined record, not silence."""
    rest = _skip_ws(text, end)
    if rest < len(text):
        yield (
            _malformed(source_file, f"{path or '$'}+", text[rest:], ValueError("text after the array")),
            len(text),
        )


def iter_json_object(text: str, pos: int) -> Iterator[tuple[str, Any, int, int]]:
    """Members of the JSON object at `pos`: (key, value, value start, value end). Raises ValueError when
    malformed."""
    pos = _skip_ws(text, pos)
    if pos >= len(text) or text[pos] != "{":
        raise ValueError(f"expected a JSON object at char {pos}")
    pos = _skip_ws(text, pos + 1)
    if pos < len(text) and text[pos] == "}":
        _after_object(text, pos + 1)
        return
    while True:
        key, pos = _DECODER.raw_decode(text, pos)
        if not isinstance(key, str):
            raise ValueError(f"expected a key at char {pos}")
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] != ":":
            raise ValueError(f"expected ':' at char {pos}")
        start = _skip_ws(text, pos + 1)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except RecursionError:
            value, end = TOO_DEEP, skip_json_value(text, start)
        yield key, value, start, end
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "}":
            _after_object(text, pos + 1)
            return
        raise ValueError(f"expected ',' or '}}' at char {pos}")


def _after_object(text: str, end: int) -> None:
    if _skip_ws(text, end) < len(text):
        raise ValueError(f"text after the object at char {end}")


def read_json_list(text: str, source_file: str) -> Iterator[SourceRecord]:
    """A JSON array of records (location `[i]`)."""
    for record, _ in iter_json_array(text, 0, source_file):
        yield record


def read_json_entries(text: str, source_file: str) -> Iterator[SourceRecord]:
    """A JSON object id -> record (location `[id]`); the id is put in `context['key']`."""
    pos = 0
    members = iter_json_object(text, 0)
    while True:
        try:
            key, value, start, end = next(members)
        except StopIteration:
            return
        except (ValueError, RecursionError) as exc:
            yield _malformed(source_file, "$[...]", text[pos:], exc)
            return
        pos = end
        location = f"[{json.dumps(key)}]"
        if value is TOO_DEEP:
            yield _malformed(source_file, location, text[start:end], RecursionError())
            continue
        yield SourceRecord(source_file, location, text[start:end], value, context={"key": key})
