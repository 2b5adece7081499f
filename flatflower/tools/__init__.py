"""The user's commands: the ``flatflower`` command (cli.py, a thin layer over commands.py), run
preparation (prepare.py), reports, sweeps, benchmarks, landscapes, flatness and the presets.
They call the runtime (runtime/: the engines, the vectorised trainer, the SuperNode worker,
certificates), which imports nothing of them; nothing here runs inside the ServerApp or a
ClientApp (server/, client/)."""
