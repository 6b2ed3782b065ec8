"""Configuration: frozen dataclasses built once (from CLI flags or a model's config.json) and
passed down, and every default, stated once (`defaults`). `engine` holds the model's, the KV
cache's, the scheduler's and the engine's; `serving` a node's network, HTTP, router, cluster,
TLS and secret settings. Nothing below the CLI reads the environment. Everything is importable
from `pdserve.config` itself."""

from pdserve.config.defaults import *  # noqa: F403
from pdserve.config.engine import *  # noqa: F403
from pdserve.config.serving import *  # noqa: F403
