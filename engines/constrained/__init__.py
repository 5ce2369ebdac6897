"""Constrained decoding: grammars for JSON and schemas (llguidance), and tool
calls (rendering offered tools, reading calls back)."""
