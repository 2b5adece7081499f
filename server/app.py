"""The ServerApp: reads the run config and runs the federation (server/run.py)."""

from __future__ import annotations

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from common.config import RunConfig
from server.run import run_server

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, RunConfig.from_mapping(context.run_config))
