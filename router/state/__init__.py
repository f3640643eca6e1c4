"""The router's state in Redis: keys, Lua scripts, tenant queues, tenants, API keys and the
replicas' load reports. Every multi-key transition is one script in ``scripts/``."""
