"""One chat-shaped request, whatever API family sent it: what the template renders and how the reply is read.

Every family that runs a chat (OpenAI chat and, through it, Responses; Anthropic Messages; Ollama's /api/chat and
templated /api/generate) translates its body into OpenAI-shaped messages and tool dicts and calls `plan_chat`. The
plan holds the server's tool-call format (`--tool-call-parser` or the template's family), the reasoning parser
(`--reasoning-parser`, unless the request turned thinking off), the prompt (`prepare_chat`: tools offered in the
template's way or as a preamble) and the `OutputParser` that splits the reply into reasoning, answer and calls.
Image parts (OpenAI's `image_url`, which every family's images become) are checked
(server/media.py) and stand in the rendered messages as `{"type": "image"}`, as HF vision templates expect; a model
without a vision tower refuses them. `with_budget` adds a reasoning budget (the engine forces the end tag when it is spent). `sampling_fields()` gives what the plan adds to any family's SamplingParams: the reasoning tags (a grammar waits
for the reasoning to end, as vLLM), whether special tokens stay in the text (a tool format that marks calls
with one) and the call markers by which a call that repeats one already made ends the turn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lmserve.parsers.output import OutputParser
from lmserve.parsers.reasoning import ReasoningParser, parser_for
from lmserve.parsers.tool_formats import ToolFormat
from lmserve.sampling_params import SamplingParams
from lmserve.server.api.tools import output_parser, prepare_chat, template_supports_tools, tool_format
from lmserve.server.media import ImageSource, split_images
from lmserve.server.served import Chat, ModelState


@dataclass(frozen=True)
class ChatPlan:
    """A chat request's prompt, tool format, reasoning parser and reply parser (None: the reply is plain text)."""

    chat: Chat
    fmt: ToolFormat
    reasoning: ReasoningParser | None
    parser: OutputParser | None
    tools: list[dict]  # the OpenAI tool dicts the model may call ([]: none)

    @property
    def images(self) -> tuple[ImageSource, ...]:
        """The chat's images in prompt order, checked but not yet loaded: ModelState.start fetches and decodes them
        into the EngineRequest's `mm_inputs` (a tuple of ImageData) before the template runs."""
        return self.chat.images

    def sampling_fields(self) -> dict[str, Any]:
        """SamplingParams fields this plan sets: the reasoning tags, special tokens kept for a tool format (or a
        reasoning parser) whose marker is one, and the call markers that end the turn at a repeated call."""
        return {"reasoning_tags": None if self.reasoning is None else (self.reasoning.start, self.reasoning.end),
                "repeat_stop": self.fmt.call_span if self.tools else None,
                "skip_special_tokens": not ((self.tools and self.fmt.keeps_special_tokens)
                                            or (self.reasoning is not None and self.reasoning.keeps_special_tokens))}


def with_budget(params: SamplingParams, plan: ChatPlan, budget: int | None) -> SamplingParams:
    """`params` with a reasoning budget (the request's budget_tokens or effort level), where a reasoning parser
    names the tags the engine forces; unchanged without one (no budget asked, or no reasoning to bound)."""
    if budget is None or plan.reasoning is None:
        return params
    return dataclasses.replace(params, reasoning_budget=budget)


def plan_chat(st: ModelState, messages: list[dict], tools: list[dict], template_kwargs: dict[str, Any] | None = None,
              thinking: bool | None = None) -> ChatPlan:
    """The plan of a chat of OpenAI-shaped `messages` offering `tools`; `template_kwargs` go to the template (after
    the tools), `thinking` False turns the reasoning parser off where the template has no switch for it."""
    messages, images = split_images(messages, st.config.media)  # image_url parts -> {"type": "image"}
    st.check_images(len(images))  # a text model refuses before any image is fetched or decoded
    fmt = tool_format(st)
    switches = {**(template_kwargs or {}), **({"enable_thinking": False} if thinking is False else {})}
    reasoning = parser_for(st.config.reasoning_parser, switches)
    supports = template_supports_tools(st.front.tokenizer.chat_template)
    rendered, kwargs = prepare_chat(messages, tools, supports, fmt)
    chat = Chat(rendered, {**(template_kwargs or {}), **kwargs}, tuple(images))
    return ChatPlan(chat, fmt, reasoning, output_parser(tools, fmt, reasoning), tools)
