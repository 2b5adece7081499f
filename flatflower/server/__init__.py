"""What the ServerApp process runs: the ServerApp itself (app.py), the run loop that sets a
run up, drives the strategy's rounds, evaluates centrally and checkpoints (run.py), and what it
writes into the run directory: config, metrics, checkpoints and the claim on the directory
(rundir.py), per-client lines (clients.py), progress.json (progress.py) and TensorBoard events
(tensorboard.py). The engines that start it live elsewhere (runtime/engines/), and so does the
``flatflower`` command (tools/)."""
