"""Structured outputs: grammars compiled by xgrammar, applied as a token mask before sampling.

compiler.py turns a StructuredOutputsParams into a compiled grammar (bounded in time and memory,
cached); grammar.py holds one request's matcher (advance, roll back, fill its mask rows); schema.py
names the JSON-schema keywords that would otherwise be ignored; limit.py (with json_scan.py) steers a JSON
answer near max_tokens to its shortest valid completion, so it parses when the limit binds. Tool-call grammars are built by
parsers/tool_grammar.py, one per tool-call format.
"""
