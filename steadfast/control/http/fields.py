"""Body fields a request model does not declare, sorted by who documents them, so none is silently dropped.

A field OpenAI, vLLM, SGLang or llama.cpp documents is served (declared on the model), accepted because
it cannot change the output (`metadata`, `service_tier`...), or refused with a 400 naming it unless it
holds its neutral value. A field nobody documents is reported: a warning (once per name) and the
`X-Steadfast-Ignored-Fields` response header. Owns no I/O beyond that log line.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from steadfast.control.http.errors import APIError

log = logging.getLogger(__name__)

IGNORED_HEADER = "X-Steadfast-Ignored-Fields"
_HEADER_NAMES = 16  # names in the header; more are counted
_NAME_CHARS = 64
_LOGGED_MAX = 256  # distinct names logged; a client inventing names cannot grow this set past it
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-\[\]]")
ABSENT = object()

# Field -> its neutral values: any other value asks for something not served here. `()`: no value is
# neutral but null. Sources: the OpenAI API reference, vLLM's and SGLang's OpenAI-compatible servers,
# llama.cpp's server README.
_BOTH: dict[str, tuple[Any, ...]] = {
    # vLLM / SGLang sampling extensions
    "length_penalty": (1, 1.0),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "prompt_logprobs": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "request_id": (),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
    # SGLang
    "no_stop_trim": (False,),
    "lora_path": (),
    "rid": (),
    "return_hidden_states": (False,),
    # llama.cpp
    "n_probs": (0,),
    "mirostat": (0,),
    "typical_p": (1, 1.0),
    "repeat_penalty": (1, 1.0),
    "dry_multiplier": (0, 0.0),
}
_CHAT: dict[str, tuple[Any, ...]] = {
    # OpenAI chat
    "functions": (),
    "function_call": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    # vLLM / SGLang chat
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "documents": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "mm_processor_kwargs": (),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
}
_COMPLETION: dict[str, tuple[Any, ...]] = {
    # vLLM completions
    "add_special_tokens": (True,),
}
# OpenAI fields that cannot change what is generated: accepted with no effect.
_NO_EFFECT = ("metadata", "service_tier", "prompt_cache_key", "safety_identifier", "store")
# Fields inside one chat message.
_MESSAGE: dict[str, tuple[Any, ...]] = {"function_call": (), "audio": ()}
_MESSAGE_NO_EFFECT = ("refusal",)
_STREAM_OPTIONS: dict[str, tuple[Any, ...]] = {"continuous_usage_stats": (False,)}
_STREAM_OPTIONS_NO_EFFECT = ("include_obfuscation",)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # `True == 1` in Python: a bool is neutral only where the neutral value is a bool, and the reverse.
    return value is None or any(isinstance(value, bool) == isinstance(n, bool) and value == n for n in neutral)


def _refused(name: str, why: str) -> APIError:
    return APIError(f"Unsupported parameter '{name}': {why}.", param=name, code="unsupported_parameter")


def _check_no_effect(name: str, value: Any) -> None:
    if name == "store" and value not in (None, False):
        raise _refused("store", "completions are not stored; leave it false")
    if name == "metadata" and value is not None:
        if not isinstance(value, dict) or len(value) > METADATA_PAIRS:
            raise APIError(f"'metadata' must be an object of at most {METADATA_PAIRS} pairs.", param="metadata")
        for k, v in value.items():
            if len(k) > METADATA_KEY_CHARS or not isinstance(v, str) or len(v) > METADATA_VALUE_CHARS:
                raise APIError(
                    f"'metadata' keys have at most {METADATA_KEY_CHARS} characters and its values are strings of "
                    f"at most {METADATA_VALUE_CHARS}.",
                    param="metadata",
                )


Peers = dict[str, tuple[Any, ...]]


def _sort(extra: dict[str, Any], peers: Peers, no_effect: tuple[str, ...], prefix: str, unknown: list[str]) -> None:
    for name, value in extra.items():
        where = prefix + name
        if name in no_effect:
            _check_no_effect(name, value)
        elif name in peers:
            if not _neutral(value, peers[name]):
                raise _refused(where, "not supported by this server")
        else:
            unknown.append(where)


def unknown_fields(body: Any, chat: bool) -> list[str]:
    """The fields of `body` (a parsed request with `extra="allow"`) nobody documents; a 400 for a
    documented one asking for what is not served."""
    unknown: list[str] = []
    peers = {**_BOTH, **(_CHAT if chat else _COMPLETION)}
    _sort(body.model_extra or {}, peers, _NO_EFFECT, "", unknown)
    if body.stream_options is not None:
        options = body.stream_options.model_extra or {}
        _sort(options, _STREAM_OPTIONS, _STREAM_OPTIONS_NO_EFFECT, "stream_options.", unknown)
    for i, message in enumerate(getattr(body, "messages", ())):
        _sort(message.model_extra or {}, _MESSAGE, _MESSAGE_NO_EFFECT, f"messages[{i}].", unknown)
    return unknown


class IgnoredReport:
    """Says each ignored name once in the log (bounded) and names them in a response header."""

    def __init__(self) -> None:
        self._logged: set[str] = set()

    def header(self, names: Sequence[str]) -> dict[str, str]:
        if not names:
            return {}
        safe = [_UNSAFE.sub("?", n[:_NAME_CHARS]) for n in names]
        fresh = [n for n in dict.fromkeys(safe) if n not in self._logged]
        if fresh and len(self._logged) < _LOGGED_MAX:
            self._logged.update(fresh[: _LOGGED_MAX - len(self._logged)])
            log.warning("request fields no peer documents were ignored: %s", ", ".join(fresh[:_HEADER_NAMES]))
        shown = ",".join(safe[:_HEADER_NAMES])
        more = len(safe) - _HEADER_NAMES
        return {IGNORED_HEADER: shown + (f",+{more} more" if more > 0 else "")}
