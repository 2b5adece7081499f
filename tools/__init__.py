"""The user's commands: ``flatflower`` (cli.py, a thin layer over commands.py) with its run
preparation (prepare.py), progress display (progress.py), presets (presets.py and the TOML
files of presets/), reports (report.py), sweeps (sweep.py), benchmarks (bench.py, throughput.py,
loop.py), saved runs and what is measured on them (saved.py, flatness_cmd.py, landscape.py),
the data check (datacheck.py) and ``flatflower certs``. Nothing here runs inside the ServerApp
or a ClientApp (server/, client/); the engines that carry a run are the runtime, not commands."""
