"""The ``fairserve`` command line.

At this stage ``fairserve up`` runs one engine behind a minimal local OpenAI-style endpoint
(``replicas.local_server``); the Ray Serve cluster with tenant queues replaces it later.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from cluster.tenants_cli import add_tenants_parser


def _up(args: argparse.Namespace) -> int:
    import uvicorn

    from replicas.engine.async_engine import TorchEngine
    from replicas.engine.config import EngineConfig
    from replicas.local_server import build_app

    config = EngineConfig(**({"model": args.model} if args.model else {}), num_threads=args.threads)
    engine = TorchEngine(config)
    print(f"loading {config.model} ...", flush=True)
    started = time.perf_counter()

    async def serve() -> None:
        await engine.start()
        load = engine.load()
        base = f"http://{args.host}:{args.port}/v1"
        print(f"engine ready in {time.perf_counter() - started:.1f} s: "
              f"{load.num_total_kv_blocks} KV blocks, model {config.served_model_name}")
        print(f"\nbase URL: {base}\n")
        print(f"  curl {base}/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{config.served_model_name}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'\n")
        print(f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='local'); "
              f"print(c.chat.completions.create(model='{config.served_model_name}', "
              f"messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)\"\n", flush=True)
        app = build_app(engine, config.served_model_name)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
        try:
            await server.serve()
        finally:
            await engine.shutdown()

    asyncio.run(serve())
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="fairserve", description="fairserve: multi-tenant LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="serve the default model locally (CPU)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--model", default=None, help="a GGUF file or a Hugging Face directory")
    up.add_argument("--threads", type=int, default=None, help="torch threads for the engine")
    up.set_defaults(func=_up)
    add_tenants_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
