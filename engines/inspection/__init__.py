"""One-shot child processes the catalog runs to inspect models (probe,
quantize, evaluate), and the messages they exchange with it on stdin/stdout.
Called "inspection" so that "tools" means only the tools of a chat request."""
