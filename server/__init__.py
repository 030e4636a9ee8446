"""The OpenAI-compatible HTTP server (Starlette on uvicorn); see docs/api.md."""
