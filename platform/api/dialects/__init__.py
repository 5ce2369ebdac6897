"""The API dialects other than OpenAI's chat completions (issue 35): each a
translation at the edge onto the one pipeline (api.pipeline)."""
