"""The admin API: tenants, keys, usage and the audit log over HTTP, on the operators' port."""
