"""The ServerApp: reads the run config and runs the federation (server/run.py)."""

from __future__ import annotations

import os

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flatflower.common import fastpoll
from flatflower.common.config import RunConfig
from flatflower.server.run import run_server

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    if os.environ.get(fastpoll.ENV) == "1":  # flatflower local --fast-poll
        fastpoll.patch_serverapp()
    run_server(grid, RunConfig.from_mapping(context.run_config))
