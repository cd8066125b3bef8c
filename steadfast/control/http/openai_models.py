"""Request bodies of the OpenAI-compatible API, validated strictly (a string is not a number).

Fields OpenAI defines that Steadfast does not implement are accepted only at their neutral value; any
other value is a 400 naming the field, never silently ignored. Undeclared fields are kept (`extra="allow"`)
for fields.py to sort: a peer's field refused or accepted, anyone else's reported. Extensions: `top_k`, `priority`,
`ignore_eos`, `stop_token_ids`, `return_token_ids` (each choice also carries its token ids), `speculative`
(false: this request never drafts, where the worker speculates; its output is the same either way),
`logprobs_mode` (vLLM's modes: `raw_logprobs`, or `processed_logprobs` for the distribution each token is
drawn from).
Every string, wherever it is in a body, must be valid Unicode: a lone surrogate (JSON `"\\ud800"`) is a 400.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

# A JSON number: an int is taken (as a float), a bool or a string is not. Not `StrictFloat | StrictInt`:
# bounds put on a union are checked but missing from the JSON schema, which then allows any number.
Number = StrictFloat
# Bounds on client numbers, so a value the engine cannot hold (a C long, a tensor index) is a 400 here
# and never an error inside a step shared with other requests.
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's own bound
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode(value: Any) -> Any:
    """`value`, refused if a string in it (a key too) holds a lone surrogate: JSON lets a client send one,
    but it is no text, and every later step that encodes the body (its digest, logs) would fail on it."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise ValueError("the text holds a lone surrogate (not valid Unicode)")
    elif isinstance(value, dict):
        for key, item in value.items():
            _unicode(key)
            _unicode(item)
    elif isinstance(value, list):
        for item in value:
            _unicode(item)
    return value


Text = Annotated[StrictStr, AfterValidator(_unicode)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_unicode)]


class OpenBody(BaseModel):
    """A body part that keeps its undeclared fields for fields.py, held to the same rules as the rest
    (valid Unicode) and in name order, so the body's digest does not depend on their order."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _extra(self) -> OpenBody:
        if self.__pydantic_extra__:
            _unicode(self.__pydantic_extra__)
            self.__pydantic_extra__ = dict(sorted(self.__pydantic_extra__.items()))
        return self


class StreamOptions(OpenBody):
    include_usage: StrictBool = False


class _Sampling(OpenBody):
    model: Text
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    priority: Literal["high", "normal", "low"] = "normal"
    ignore_eos: StrictBool = False
    speculative: StrictBool = True
    return_token_ids: StrictBool = False
    # vLLM's logprobs modes (its server-wide `--logprobs-mode`, per request here): the model's raw
    # log-softmax (the default), or that of the distribution the token is drawn from
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=10.0)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = None
    logit_bias: (
        Annotated[dict[Text, Annotated[Number, Field(ge=-100.0, le=100.0)]], Field(max_length=MAX_LOGIT_BIAS)] | None
    ) = None
    user: Text | None = None
    # Structured outputs (structured.py): OpenAI's, vLLM's, SGLang's and llama.cpp's forms.
    response_format: JSONObject | None = None
    structured_outputs: JSONObject | None = None
    guided_json: JSONObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Text | None = None  # (one backend here, llguidance: any name is served by it)
    regex: Text | None = None
    ebnf: Text | None = None
    grammar: Text | None = None
    json_schema: JSONObject | Text | None = None

    @property
    def runs(self) -> int:
        """Sequences decoded per prompt: its choices (`best_of` above n: the runs they are picked from)."""
        return self.n

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for the first feature asked for that is not implemented."""
        return None

    def bias(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; ValueError naming a key that is no token id here."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit() or int(key) >= vocab:
                raise ValueError(f"'logit_bias' key {key[:32]!r} is not a token id in [0, {vocab})")
            pairs.append((int(key), float(value)))
        return tuple(sorted(pairs))

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


MAX_PROMPTS = 64  # (each with its choices: resume_token.MAX_CHOICES in all)


class CompletionRequest(_Sampling):
    prompt: (
        Text
        | Annotated[list[Text], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
    )
    # 0: with `echo`, the prompt alone (scored, with `logprobs`: what evaluation harnesses ask)
    max_tokens: Annotated[StrictInt, Field(ge=0, le=INT32_MAX)] | None = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    suffix: Text | None = None

    @property
    def logprob_count(self) -> int:
        """The worker's `logprobs`: -1 none, else the alternatives per token (0: the chosen token's alone)."""
        return -1 if self.logprobs is None else self.logprobs

    @property
    def runs(self) -> int:
        return max(self.best_of or 1, self.n)

    @property
    def prompt_logprob_count(self) -> int:
        """The worker's `prompt_logprobs`: the prompt's logprobs go with its echo where logprobs are asked."""
        return self.logprob_count if self.echo else -1

    @property
    def generated(self) -> int | None:
        """The tokens a choice generates: `max_tokens`, one where it is 0 (a prefill samples one: dropped)."""
        return 1 if self.max_tokens == 0 else self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens 0 (the prompt alone) needs echo"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", "best_of must be at least n"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


MAX_TOOLS = 128  # OpenAI's own bound
MAX_TOOL_CALLS = 128  # in one assistant message of the history
TOOL_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME)]
    description: Annotated[Text, Field(max_length=8192)] | None = None
    parameters: JSONObject | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME)]


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[Text, Field(max_length=64)]
    arguments: Text  # (JSON text, as the model wrote it; counted with the prompt's characters)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Annotated[Text, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction
    index: StrictInt | None = None  # (a stream's: clients that gather deltas send it back; no effect)


class ChatMessage(OpenBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None  # (assistant's)
    tool_call_id: Annotated[Text, Field(max_length=256)] | None = None  # (a tool's answer: to which call)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None

    @property
    def logprob_count(self) -> int:
        """The worker's `logprobs`: -1 none, else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else -1

    @property
    def prompt_logprob_count(self) -> int:
        return -1  # (a chat never echoes its prompt)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
