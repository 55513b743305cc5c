"""A router's configuration (`ServerConfig`): what it serves under which name, its limits and
timeouts, its API key. Built from the command line by `router.main.server_config`; read by the
server (`server.py`) and its generation endpoints (`completions.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    tool_call_parser: str | None = None  # router.tool_calls.PARSERS: chat tool calls parsed
    max_running: int = 512
    max_queue: int = 1024
    max_queue_per_client: int | None = None  # requests one client may have waiting (None: half)
    api_key: str | None = None
    log_requests: bool = False
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json
    body_timeout: float = 30.0  # seconds to receive a request body
    write_timeout: float = 60.0  # seconds one write to a client may wait for it to read
    header_timeout: float = 10.0  # seconds a new connection has to send its first request head
    keepalive_timeout: float = 75.0  # seconds an idle kept-alive connection stays open
    max_connections: int | None = None  # open connections (None: the fd limit less a reserve)
    kv_share: float = 1.0  # the part of the decode nodes' KV this router's requests may hold
