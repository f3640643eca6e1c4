"""Model replicas: the engine interface, the torch engine, and (later) the Ray Serve deployment."""
