"""The HTTP API: OpenAI's routes and schemas, the checks before a request is queued, and the
OpenAI objects shaped from its response events. Errors become OpenAI bodies in ``routes``."""
