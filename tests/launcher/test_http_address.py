"""`bullet launch` takes its HTTP address before it loads anything: a port in use, a host that does not
resolve or is not this machine's is one line on stderr and exit code 2, with no weight loaded and no
profile measured — and `--port 0` serves on the free port it names."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from bullet.frontend.http.listen import ListenError, bind_http_sockets, bound_port
from tests.launcher.test_device_choice import launch_error, no_weights_loaded  # noqa: F401  (a fixture)


@pytest.fixture
def busy_port():
    """A port held by a listening socket, as another server would hold it."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def test_a_port_in_use_is_one_line_before_anything_loads(busy_port, capsys, no_weights_loaded):  # noqa: F811
    err = launch_error(capsys, "--port", str(busy_port))
    assert err == (f"bullet launch: cannot listen on 127.0.0.1:{busy_port}: the port is in use (another server?); "
                   "pick another --port, or --port 0 for a free one")


def test_a_host_that_does_not_resolve_is_named(capsys, no_weights_loaded):  # noqa: F811
    err = launch_error(capsys, "--host", "256.1.1.1", "--port", "0")
    assert err.startswith("bullet launch: cannot listen on 256.1.1.1:0: cannot resolve the host '256.1.1.1'")


def _nonlocal_bind_allowed() -> bool:
    try:
        with open("/proc/sys/net/ipv4/ip_nonlocal_bind") as setting:
            return setting.read().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(_nonlocal_bind_allowed(), reason="net.ipv4.ip_nonlocal_bind=1 here: any address binds")
def test_an_address_of_another_machine_is_named(capsys, no_weights_loaded):  # noqa: F811
    err = launch_error(capsys, "--host", "192.0.2.1", "--port", "0")  # TEST-NET-1: never a local address
    assert err == ("bullet launch: cannot listen on 192.0.2.1:0: 192.0.2.1 is not an address of this machine; "
                   "--host takes one of its addresses, or 0.0.0.0 for all")


def test_sockets_are_bound_not_listening_and_not_inherited():
    sockets = bind_http_sockets("127.0.0.1", 0)
    port = bound_port(sockets)
    try:
        assert len(sockets) == 1 and port > 0
        assert not sockets[0].get_inheritable()  # no worker process holds the port
        with pytest.raises(ConnectionRefusedError):  # a client is refused while the model loads, as before
            socket.create_connection(("127.0.0.1", port), timeout=5)
        sockets[0].listen()  # serving: another server cannot take the port
        with pytest.raises(ListenError, match="the port is in use"):
            bind_http_sockets("127.0.0.1", port)
    finally:
        for sock in sockets:
            sock.close()
    bind_http_sockets("127.0.0.1", port)[0].close()  # closed: free again


def test_a_name_with_several_addresses_gets_one_port_for_all():
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)}
    try:
        sockets = bind_http_sockets("localhost", 0)
    except ListenError as exc:  # e.g. ::1 listed but IPv6 off in this container: the whole bind fails, as asyncio's
        pytest.skip(f"localhost's addresses {sorted(addresses)} cannot all be bound here: {exc}")
    try:
        assert {s.getsockname()[0] for s in sockets} == addresses
        assert len({s.getsockname()[1] for s in sockets}) == 1
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.slow
def test_port_0_serves_on_the_port_it_names():
    """As a user runs it: the embedded model on --port 0; the start line names the port that answers."""
    server = subprocess.Popen([sys.executable, "-m", "bullet.cli", "launch", "--port", "0"],
                              stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    serving = threading.Event()

    def read_stderr() -> None:  # read to the end: a full pipe would stall the server
        for line in server.stderr:
            lines.append(line.rstrip())
            if "Uvicorn running on" in line:
                serving.set()
        serving.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        assert serving.wait(timeout=300) and server.poll() is None, "\n".join(lines[-20:])
        starts = [m for line in lines if (m := re.search(r"\[bullet\] starting: .* http://127\.0\.0\.1:(\d+)$", line))]
        assert len(starts) == 1, lines
        port = int(starts[0].group(1))
        assert port > 0
        running = f"Uvicorn running on http://127.0.0.1:{port} (Press CTRL+C to quit)"
        assert any(line.endswith(running) for line in lines), lines
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as reply:
            assert reply.status == 200
        with open(f"/proc/{server.pid}/cmdline") as title:
            assert f"port={port}" in title.read()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
