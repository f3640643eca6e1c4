"""The HTTP API: OpenAI's routes and schemas, the checks before a request is queued, and the
OpenAI objects shaped from its response events. The route table is ``routes``; errors become
OpenAI bodies in ``error_handlers`` alone."""
