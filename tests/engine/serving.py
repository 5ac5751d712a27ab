"""A real `ft serve` on 127.0.0.1 for tests: started once per module, stopped at its end."""

from __future__ import annotations

from contextlib import contextmanager

import httpx

from ft.bench.server_process import start_server
from tests.conftest import ft_env

API_KEY = "test-key"
START_TIMEOUT_S = 180


@contextmanager
def running_server(tmp_path_factory, *serve_args: str, api_key: str | None = API_KEY):
    """Yield (server, client): the server on the built-in tiny model, a client with the key."""
    cache = tmp_path_factory.getbasetemp() / "ft-cache"  # the conftest's: one tiny model per run
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [*serve_args, "--host", "127.0.0.1"] + (["--api-key", api_key] if api_key else [])
    server = start_server(
        args, env=ft_env(FT_CACHE_DIR=str(cache)), log_path=log_path, timeout_s=START_TIMEOUT_S
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=60, trust_env=False) as c:
            yield server, c
    finally:
        status = server.stop()
        assert status == 0, f"ft serve exited with {status}:\n{server.log_tail()}"
