"""The OpenAI-compatible router, by concern, in the order a request meets them:

- ``router.api``: the HTTP API. The route table (``routes``), answers whole or as SSE
  (``reply``, ``sse``), resuming (``resume``), errors as OpenAI bodies (``error_handlers``),
  the middleware (``tenant_gate``, ``body_limit``), the Responses API (``responses``),
  OpenAI's schemas (``openai_models``) and the served OpenAPI document (``openapi``), the
  checks a request passes before it is queued (``sampling``, ``prompt_tokenizer``), and the
  OpenAI objects built from response events (``shaper``).
- ``router.service``: the request path below HTTP: authenticate, validate, admit, read back.
- ``router.state``: what lives in Redis: the client (``redis_client``), every key
  (``keys``), the Lua scripts (``scripts``, ``scripts/*.lua``), the tenant queues
  (``queues``), tenants and API keys, and the replicas' load reports (``capacity``).
- ``router.dispatch``: granted requests on the replicas: the grant loop (``dispatcher``), one
  request's relay and migration (``relay``, ``progress``), and the response streams that join
  a dispatcher to the client's router (``streams``, ``stream_mux``, ``response_events``).
- ``router.telemetry``: Prometheus metrics, OpenTelemetry tracing, and what the router holding
  a connection records about its request (``request_observer``).
- ``router.server``: all of it as a Ray Serve ingress deployment.

The subpackages do not re-export their modules: a replica imports ``router.state.keys`` and
``router.api.prompt_tokenizer`` without FastAPI or the whole router coming with them.
"""
