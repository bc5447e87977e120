"""Output parsers: generated text -> reasoning, content and tool calls, for every API family.

Pure text transformers, each in a whole-text form and an incremental (streaming) form that agree on any split
of the text into deltas: `reasoning.py` (`--reasoning-parser`: qwen3, deepseek_r1, gpt_oss), `tool_calls.py`
(the streaming driver and whole-text parse shared by every tool-call format), `tool_formats.py`
(`--tool-call-parser`: hermes, llama3_json, mistral, pythonic, qwen3_xml, phi4_mini, gemma3, harmony; each
format's begin pattern, argument reader, history text and prompt example; the default found from the chat
template), `tool_grammar.py` (each format's xgrammar structural tag, for tool_choice auto / required / named),
`output.py` (reasoning then tools: what a route calls), `events.py` (the deltas the streaming forms emit).
Nothing here knows an HTTP API's shapes: server/api/ modules translate.
"""
