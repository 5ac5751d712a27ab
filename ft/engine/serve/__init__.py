"""`ft serve`: the OpenAI-compatible HTTP server around one engine worker thread."""
