"""The OpenAI-compatible router: auth, quotas, tenant queues in Redis, dispatch (coming next)."""
