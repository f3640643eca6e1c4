"""Model replicas: the engine contract (``engine``), its implementations (``torch_engine``,
``vllm_engine``) and the Ray Serve deployment that hosts one (``server``)."""
