"""Two real servers shared by the HTTP tests (a startup costs ~5-50 s on two cores): `server` with
the default flags, and `secured` with --api-key and a KV pool small enough to fill. Tests run one
at a time, so token counter deltas read around a test belong to that test. Both stop when the last
test of this folder ran (package scope): an idle server still wakes to supervise its workers, and
the rest of the suite runs beside nothing it does not need."""

from __future__ import annotations

import pytest

from tests.frontend.helpers import SECURED_ARGS, SERVER_ARGS, SecuredServer
from tests.server_utils import ServerProcess


@pytest.fixture(scope="package")
def server():
    with ServerProcess(*SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="package")
def secured():
    with SecuredServer(*SECURED_ARGS) as srv:
        yield srv


@pytest.fixture(scope="package")
def hf_tokenizer(server):
    """The server's tokenizer as the real clients load it: a local Hugging Face directory."""
    transformers = pytest.importorskip("transformers")
    path = server.get("/model_info")[1]["tokenizer_path"]
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(scope="package")
def openai_client(server):
    """The official `openai` client on the default server's /v1 (no retries: a failure shows)."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
