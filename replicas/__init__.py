"""Model replicas: the Ray Serve deployment hosting one engine (``server``), the engine contract
(``engine``, torch-free) and its implementations (``torch_engine``, ``vllm_engine``), what the
router knows of a model without loading it (``model_info``), the engine's trace spans
(``tracing``), and the one package the router shares with them (``protocol``: the router imports
nothing else of this package, and this package imports nothing of the router).

No names are re-exported here: importing the deployment or an engine loads torch, which a
router process must not (``replicas.protocol`` and ``replicas.engine`` are light)."""
