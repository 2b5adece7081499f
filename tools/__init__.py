"""The user's tools around a federation: the ``flatflower`` command (cli.py, a thin layer over
commands.py), run preparation (prepare.py), the engines (engines.py: a real local federation,
Flower's Ray simulation, in-process), reports, sweeps, benchmarks, certificates and presets.
Nothing here runs inside the ServerApp or a ClientApp (server/, client/)."""
