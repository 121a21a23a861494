"""Prompt rendering and reply parsing: the model's chat template, tool-call parsers, exact history.

`Renderer` (render.py) turns canonical messages into prompt ids with the model's own HF chat
template (or the Hermes-style fallback in template.py when that template cannot show tools) and
turns sampled ids back into content, reasoning and tool calls (parsers.py). `History`
(history.py) keeps a session's calls so later prompts extend earlier ones token for token.
"""
