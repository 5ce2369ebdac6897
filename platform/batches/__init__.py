"""OpenAI-compatible Batch API: uploaded files, batch jobs, and the Celery
worker that answers their lines through the engines."""
