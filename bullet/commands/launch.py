"""`bullet launch`: start a server — the launcher loads the model once into shared memory, starts the
prefill and decode workers, and serves SGLang's native API and the OpenAI API over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import typing

import setproctitle
import uvicorn

from bullet.config import ServerArgs
from bullet.frontend.http.listen import ListenError, address_label, bind_http_sockets, bound_port

log = logging.getLogger("bullet.launch")

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


def _help(field) -> str:
    """The field's description and its default, unless the description already names one."""
    text = field.description or ""
    if "(default" in text:
        return text
    if isinstance(field.default, bool):
        shown = "on" if field.default else "off"  # a --flag/--no-flag pair: which of the two holds
    else:
        shown = "unset" if field.default is None else field.default
    return f"{text} (default: {shown})"


def add_arguments(p: argparse.ArgumentParser) -> None:
    for name, field in ServerArgs.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=_help(field))
            continue
        kind, choices = _flag_type(field.annotation)
        p.add_argument(flag, dest=name, type=kind, choices=choices, default=argparse.SUPPRESS, help=_help(field))


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engines.sampling_params import validation_message  # deferred: `bullet --help` lists commands without torch

    from bullet.launcher.device_choice import serving_device  # deferred: as above

    fields = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
    try:
        server_args = ServerArgs(**fields)
        server_args.allowed_cores()
        serving_device(server_args)  # a missing GPU or a backend that cannot divide the device: before any load
    except ValidationError as exc:
        print(f"bullet launch: {validation_message(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"bullet launch: {exc}", file=sys.stderr)
        return 2
    try:
        sockets = bind_http_sockets(server_args.host, server_args.port)  # before the model: a busy port says so at once
    except ListenError as exc:
        print(f"bullet launch: {exc}", file=sys.stderr)
        return 2
    # --port 0: the free port the kernel chose is the server's port (its log, its processes' titles, /get_server_info)
    server_args = server_args.model_copy(update={"port": bound_port(sockets)})
    try:
        return serve(server_args, sockets)
    finally:
        for sock in sockets:
            sock.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a graceful drain: the first SIGTERM/SIGINT stops admitting requests
    (503 + Retry-After) and lets the ones in flight finish for up to `shutdown_timeout` seconds
    before the usual shutdown, which ends whatever is left with an error; a second signal exits at once."""

    def __init__(self, config, runtime, shutdown_timeout: float):
        super().__init__(config)
        self.runtime, self.shutdown_timeout = runtime, shutdown_timeout
        self._drain: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn says where it listens only for an address it bound itself
            logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s (Press CTRL+C to quit)",
                                                    address_label(self.config.host, bound_port(sockets)))

    def handle_exit(self, sig, frame) -> None:
        if self.runtime.status == "starting":  # stop now, not after a start-up that can take minutes
            super().handle_exit(sig, frame)
            self.runtime.interrupt_start(sig)  # raises into the blocking start-up where it stands
            return
        if self._drain is not None or self.runtime.status != "serving" or not self.shutdown_timeout:
            return super().handle_exit(sig, frame)
        log.info("signal %d: draining (up to %.0fs); send it again to stop at once", sig, self.shutdown_timeout)
        self._drain = asyncio.get_event_loop().create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig, frame) -> None:
        try:
            await self.runtime.drain(self.shutdown_timeout)
        finally:
            super().handle_exit(sig, frame)


def serve(server_args, sockets) -> int:
    """Serves on `sockets` (bound to --host/--port by `bind_http_sockets`) until a signal or a fatal error."""
    # deferred: `bullet --help` lists commands without loading torch, the model loaders and the server
    from bullet.frontend.http.app import create_app
    from bullet.frontend.serving import ServingRuntime  # deferred: as above
    from bullet.launcher.launcher import StartupInterrupted, WorkerStartupError  # deferred: as above
    from engines.host import bound_heap_growth  # deferred: as above
    from engines.weights import ModelLoadError  # deferred: as above

    bound_heap_growth()  # before the first large allocation: the frontend runs for days
    setproctitle.setproctitle(f"bullet::launcher port={server_args.port}")
    logging.basicConfig(level=server_args.log_level.upper(), format="[%(asctime)s %(name)s] %(levelname)s %(message)s")
    runtime = ServingRuntime(server_args)
    app = create_app(server_args, runtime)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                            timeout_graceful_shutdown=5, timeout_keep_alive=server_args.timeout_keep_alive,
                            access_log=server_args.log_level == "debug")
    server = DrainingServer(config, runtime, server_args.shutdown_timeout)
    fatal: list[str] = []

    def on_fatal(what: str) -> None:
        fatal.append(what)
        server.should_exit = True

    runtime.on_fatal = on_fatal
    # a start that failed for a reason the user can fix is said in one line below, not as uvicorn's traceback
    logging.getLogger("uvicorn.error").addFilter(lambda record: runtime.startup_error is None)
    print(f"[bullet] starting: model {server_args.model_path or 'SmolLM2-135M-Instruct (embedded)'}, "
          f"policy {server_args.policy}, http://{server_args.host}:{server_args.port}", file=sys.stderr, flush=True)
    try:
        server.run(sockets=sockets)
    except (ModelLoadError, WorkerStartupError) as exc:
        print(f"bullet launch: {exc}", file=sys.stderr)
        return 1
    except SystemExit:  # uvicorn's exit when the application's start-up failed
        if runtime.startup_error is None:
            raise
    if runtime.startup_error is not None:
        print(f"bullet launch: {runtime.startup_error}", file=sys.stderr)
        if isinstance(runtime.startup_error, StartupInterrupted):
            return 128 + runtime.startup_error.sig  # the shell's code for a process a signal stopped
        return 1
    if fatal:
        print(f"bullet launch: stopped: {fatal[0]}", file=sys.stderr)
        return 1
    if not server.started:
        return 1
    return 0
