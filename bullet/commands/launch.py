"""`bullet launch`: start a server — the launcher loads the model once into shared memory, starts the
prefill and decode workers, and serves SGLang's native API and the OpenAI API over HTTP."""

from __future__ import annotations

import argparse
import logging
import sys
import typing

NAME = "launch"
HELP = "serve a model over HTTP with concurrent prefill and decode workers"
DESCRIPTION = ("Loads the model once into shared memory, starts a prefill worker and a decode worker on their own "
               "compute shares, and serves SGLang's native API (/generate, …) and the OpenAI API (/v1/…). With no "
               "arguments it serves the embedded SmolLM2-135M-Instruct on http://127.0.0.1:30000.")


def _flag_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base))
    return (base if base in (int, float, str) else str), None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bullet.config import ServerArgs

    for name, field in ServerArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind, choices = _flag_type(field.annotation)
        p.add_argument(flag, dest=name, type=kind, choices=choices, default=argparse.SUPPRESS,
                       help=f"{field.description} (default: {field.default})")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from bullet.config import ServerArgs
    from engines.sampling_params import validation_message

    fields = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
    try:
        server_args = ServerArgs(**fields)
        server_args.allowed_cores()
    except ValidationError as exc:
        print(f"bullet launch: {validation_message(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"bullet launch: {exc}", file=sys.stderr)
        return 2
    return serve(server_args)


def serve(server_args) -> int:
    import uvicorn

    from bullet.http.app import create_app
    from bullet.runtime.launcher import WorkerStartupError
    from bullet.runtime.serving import ServingRuntime
    from engines.weights import ModelLoadError

    logging.basicConfig(level=server_args.log_level.upper(), format="[%(asctime)s %(name)s] %(levelname)s %(message)s")
    runtime = ServingRuntime(server_args)
    app = create_app(server_args, runtime)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            timeout_graceful_shutdown=5, access_log=server_args.log_level == "debug")
    server = uvicorn.Server(config)
    fatal: list[str] = []

    def on_fatal(what: str) -> None:
        fatal.append(what)
        server.should_exit = True

    runtime.on_fatal = on_fatal
    print(f"[bullet] starting: model {server_args.model_path or 'SmolLM2-135M-Instruct (embedded)'}, "
          f"policy {server_args.policy}, http://{server_args.host}:{server_args.port}", file=sys.stderr, flush=True)
    try:
        server.run()
    except (ModelLoadError, WorkerStartupError) as exc:
        print(f"bullet launch: {exc}", file=sys.stderr)
        return 1
    if fatal:
        print(f"bullet launch: stopped: {fatal[0]}", file=sys.stderr)
        return 1
    if not server.started:
        return 1
    return 0
