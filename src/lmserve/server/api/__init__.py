"""One folder per API dialect, each translating its shapes onto the shared middle in server/ and nothing more.

Each `<dialect>/` exports a `Dialect` (dialect.py), one line of the registry dialects.py: openai/ (completions,
chat, models), responses/, anthropic/ (Anthropic's Messages), ollama/, tgi/ (TGI's /generate), kserve/ (KServe v2
/ Open Inference Protocol), embeddings/, lora/ (vLLM's dynamic adapter routes). The helpers they share sit here
(params, tools, tool_stream, logprobs, chunks, chat_plan, cache_replay), with openapi.py, the document for all of
them. Reasoning and tool-call parsing is lmserve/parsers/, shared by every dialect. The middle never imports this
package.
"""
