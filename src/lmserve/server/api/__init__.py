"""One module per API family, each translating its shapes onto the shared middle in server/ and nothing more.

openai.py (completions, chat, models), anthropic.py (Anthropic's Messages; its bodies in
anthropic_protocol.py), tgi.py (TGI's /generate), kserve.py (KServe v2 / Open Inference Protocol),
lora.py (vLLM's dynamic adapter routes); the OpenAI family's helpers beside it (params, tools, tool_stream,
logprobs, cache_replay) and openapi.py, the document for all of them. Reasoning and tool-call parsing is
lmserve/parsers/, shared by every family. The middle never imports this package.
"""
