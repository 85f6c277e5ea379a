"""The fixed task set and its canonical arguments.

A request names a task from a fixed set, never a free-text prompt: free text would split the
cache into near-duplicate entries and degrade the model's answers. Task arguments are
normalised here, once, for every protocol, so equal requests always share one key:
extraction fields are NFKC-normalised, whitespace-collapsed, lower-cased, de-duplicated and
sorted; a translation target language is reduced to its code.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import orjson

from app.vocabulary import OcrParams, UnsupportedParams

OCR = "ocr"  # lines with boxes from PaddleOCR (and remote Paddle Serving)
SPOTTING = "spotting"  # lines with boxes from a VLM (HunyuanOCR)
PARSING = "parsing"  # markdown
EXTRACTION = "extraction"  # JSON object of the requested fields
TRANSLATION = "translation"  # text in the target language

TASKS = (OCR, SPOTTING, PARSING, EXTRACTION, TRANSLATION)
LINE_TASKS = frozenset({OCR, SPOTTING})  # answered with OcrResult.lines
TEXT_TASKS = frozenset({PARSING, EXTRACTION, TRANSLATION})  # answered with OcrResult.text

FIELD_ARG = "field"
LANGUAGE_ARG = "target_language"
MAX_FIELDS = 32
MAX_FIELD_CHARS = 64
# Quotes and brackets would break the field list the prompt quotes; controls are noise.
_FORBIDDEN_IN_FIELD = set("'\"[]{}\\")

# HunyuanOCR translates into English or Chinese (model card); names and codes accepted.
LANGUAGES = {
    "en": {"en", "eng", "english", "en-us", "en-gb", "英文", "英语"},
    "zh": {"zh", "zho", "chi", "chinese", "zh-cn", "zh-hans", "cn", "中文", "汉语"},
}


def normalise_key(name: str) -> str:
    """A field name as requests and answers are matched: NFKC, single spaces, lower case."""
    return " ".join(unicodedata.normalize("NFKC", name).split()).lower()


def normalise_field(name: object) -> str:
    if not isinstance(name, str):
        raise UnsupportedParams("fields must be strings")
    text = normalise_key(name)
    if not text:
        raise UnsupportedParams("fields must not be empty")
    if len(text) > MAX_FIELD_CHARS:
        raise UnsupportedParams(f"a field name is longer than {MAX_FIELD_CHARS} characters")
    if any(c in _FORBIDDEN_IN_FIELD or unicodedata.category(c)[0] == "C" for c in text):
        raise UnsupportedParams("field names must not contain quotes, brackets or backslashes")
    return text


def normalise_fields(names: Iterable[object]) -> tuple[str, ...]:
    fields = tuple(sorted({normalise_field(name) for name in names}))
    if not fields:
        raise UnsupportedParams("task extraction needs at least one field")
    if len(fields) > MAX_FIELDS:
        raise UnsupportedParams(f"task extraction takes at most {MAX_FIELDS} fields")
    return fields


def normalise_language(raw: object) -> str:
    if isinstance(raw, str):
        value = " ".join(unicodedata.normalize("NFKC", raw).split()).lower().replace("_", "-")
        for code, names in LANGUAGES.items():
            if value in names:
                return code
    raise UnsupportedParams(
        f"target_language must be one of {', '.join(sorted(LANGUAGES))} (English or Chinese)"
    )


def task_params(
    base: OcrParams,
    task: str,
    fields: Iterable[object] | None = None,
    target_language: object | None = None,
    default_language: str = "en",
) -> OcrParams:
    """``base`` with ``task`` and its normalised arguments; raises ``UnsupportedParams``.

    Whether the engine can run the task is the engine's ``check_params`` decision.
    """
    if task not in TASKS:
        raise UnsupportedParams(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if fields is not None and task != EXTRACTION:
        raise UnsupportedParams("fields apply to task extraction only")
    if target_language is not None and task != TRANSLATION:
        raise UnsupportedParams("target_language applies to task translation only")
    args: tuple[tuple[str, str], ...] = ()
    if task == EXTRACTION:
        args = tuple((FIELD_ARG, name) for name in normalise_fields(fields or ()))
    elif task == TRANSLATION:
        language = target_language if target_language is not None else default_language
        args = ((LANGUAGE_ARG, normalise_language(language)),)
    if base.task == task and base.task_args == args:
        return base  # the common case (the default task): no copy on every request
    return replace(base, task=task, task_args=args)


def require_ocr(params: OcrParams, engine_kind: str) -> None:
    """For engines whose only task is "ocr" (lines with boxes)."""
    if params.task != OCR or params.task_args:
        raise UnsupportedParams(
            f"task {params.task!r} is not offered by OCR_ENGINE={engine_kind}; tasks: {OCR}"
        )


def check_args(params: OcrParams) -> None:
    """Refuse task arguments that ``task_params`` would not have produced."""
    fields = params.arg_values(FIELD_ARG) if params.task == EXTRACTION else None
    languages = params.arg_values(LANGUAGE_ARG)
    language = languages[0] if params.task == TRANSLATION and languages else None
    expected = task_params(params, params.task, fields, language)
    if expected.task_args != params.task_args:
        raise UnsupportedParams(f"malformed arguments for task {params.task!r}")


def extraction_text(values: Mapping[str, Any]) -> str:
    """The canonical extraction payload: a compact JSON object, keys in the given order."""
    return orjson.dumps(dict(values)).decode()


def extraction_values(text: str) -> dict[str, Any]:
    value = orjson.loads(text)
    if not isinstance(value, dict):
        raise ValueError("extraction payload is not a JSON object")
    return value
