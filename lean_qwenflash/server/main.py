"""Command line of the server: read the config, refuse unsafe binds, open the model, run uvicorn."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Optional

from lean_qwenflash.common import KV_CACHE_DTYPES


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve_config(config: Optional[str] = None, host: Optional[str] = None, port: Optional[int] = None,
                 model: Optional[str] = None, kv_cache_dtype: Optional[str] = None):
    """The validated config with command-line overrides; raises ``ConfigError`` when a
    non-loopback address is asked for without ``server.api_key``."""
    from lean_qwenflash.config import ConfigError, load_config

    overrides = {} if kv_cache_dtype is None else {"kv_cache_dtype": kv_cache_dtype}
    cfg = load_config(config, model=model, **overrides)
    if host is not None:
        cfg.server.host = host
    if port is not None:
        cfg.server.port = port
    cfg.validate()
    if not is_loopback(cfg.server.host) and not cfg.server.api_key:
        raise ConfigError(f"server.api_key: binding {cfg.server.host} (not a loopback address) exposes the model "
                          "to the network; set server.api_key in the config, or bind 127.0.0.1")
    return cfg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="runtime config YAML (see configs/); default: built-in defaults")
    p.add_argument("--model", help="pack directory (overrides the config; default: the built-in model)")
    p.add_argument("--host", help="address to bind (overrides server.host; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (overrides server.port; default 8000)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="how attention stores keys and values (overrides kv_cache_dtype; default f32): q8_0 / "
                        "q4_0 blocks take 27%% / 14%% of the f32 bytes per token of context")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--trace", metavar="FILE", help="append every request's routed expert ids to FILE "
                   "(a routing trace for `lean-qwenflash replay` and `doctor --trace`)")


def run(args) -> int:
    import uvicorn

    from lean_qwenflash.runtime import Runtime
    from lean_qwenflash.server.app import create_app
    from lean_qwenflash.server.http import raise_open_files_limit, uvicorn_config

    cfg = serve_config(args.config, args.host, args.port, args.model, getattr(args, "kv_cache_dtype", None))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    old, new = raise_open_files_limit()
    log = logging.getLogger("lean_qwenflash.server")
    if new > old:
        log.info("open-files limit (RLIMIT_NOFILE) raised from %d to %d (the hard limit)", old, new)
    else:
        log.info("open-files limit (RLIMIT_NOFILE): %d (already the hard limit)", old)
    named = cfg.model is not None
    from lean_qwenflash.experts.trace import recording
    with Runtime.open(cfg) as rt, recording(rt.provider, getattr(args, "trace", None),
                                            lambda line: print(line, file=sys.stderr)):
        name = cfg.server.model_name or (Path(cfg.model).name if named else "default")
        app = create_app(rt, cfg, model_name=name)
        print(f"lean-qwenflash: serving {name!r} ({rt.store.path}) on http://{cfg.server.host}:{cfg.server.port}/v1"
              + (" (API key required)" if cfg.server.api_key else ""), file=sys.stderr)
        engine = app.state.server.engine
        if engine.budget is not None:
            print(f"lean-qwenflash: context: {engine.budget.describe()}", file=sys.stderr)
        uv = uvicorn_config(app, cfg, args.log_level)
        print(f"lean-qwenflash: connections: at most {uv.http.capacity} open (open-files limit {new}), "
              f"{uv.http.max_per_client} per client address", file=sys.stderr)
        disk = engine.prefix_cache.disk
        if disk is not None:
            print(f"lean-qwenflash: snapshots: {len(disk)} on disk in {disk.path} "
                  f"({disk.used_bytes} of {disk.capacity_bytes} bytes)", file=sys.stderr)
        server = uvicorn.Server(uv)
        try:
            server.run()
        except KeyboardInterrupt:           # uvicorn re-raises the Ctrl-C it shut down for (as uvicorn.run)
            pass
    return 0 if server.started else 3      # 3: what uvicorn.run exits with when startup fails


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lean_qwenflash.server",
                                description="OpenAI-compatible HTTP server for a lean-qwenflash model.")
    add_arguments(p)
    args = p.parse_args(argv)
    from lean_qwenflash.config import ConfigError
    from lean_qwenflash.store.format import StoreError
    try:
        return run(args)
    except (ConfigError, StoreError, ValueError, OSError) as e:
        print(f"lean-qwenflash serve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
