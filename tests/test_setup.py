"""One setup, one rule (issue 43, item 5): a run is set up by server/setup.py's prepare_run,
which the ServerApp and the command line's preflight both call; every algorithm x option rule
is said once (strategies/compatibility.py) and refused with the run config, before anything
starts, by the CLI and by the ServerApp alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from flatflower.common.config import ConfigError, RunConfig
from flatflower.runtime.engines.inprocess import run_inprocess
from flatflower.strategies.compatibility import compatibility_problems
from flatflower.strategies.registry import ALGORITHMS
from flatflower.tools.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
DP = {"dp.clip": 1.0, "aggregation": "uniform"}
SCAFFOLD_DP = "scaffold uploads control_delta besides the model"


def test_the_cli_refuses_an_algorithm_option_clash_in_one_line_and_writes_nothing(tmp_path, capsys):
    """`flatflower simulate --algorithm scaffold --set dp.clip=1 --set aggregation=uniform`:
    SCAFFOLD uploads a control variate, which client-level DP does not clip or noise."""
    run_dir = tmp_path / "r"
    code = cli(["simulate", "--algorithm", "scaffold", "--set", "dp.clip=1", "--set", "aggregation=uniform",
                "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and SCAFFOLD_DP in err
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_the_serverapp_refuses_it_before_claiming_the_run_directory(tmp_path):
    """`flwr run` hands the ServerApp the run config as given: it is refused when parsed, before
    the run directory is claimed (no .lock, no failed summary.json)."""
    from flatflower.server.app import main as server_main

    run_dir = tmp_path / "r"
    bad = {"algorithm": "scaffold", **DP, "run-dir": str(run_dir)}
    with pytest.raises(ConfigError, match=SCAFFOLD_DP):
        run_inprocess(bad, 2)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=bad)
    with pytest.raises(ConfigError, match=SCAFFOLD_DP):
        server_main(None, context)  # refused before it touches the grid
    assert not run_dir.exists()


@pytest.mark.parametrize("steps", [2, 0])
def test_every_algorithm_under_dp_is_refused_exactly_when_its_protocol_or_server_says_so(steps):
    """The rule, said once, is what the run config checks: an algorithm that uploads more
    than the model (its protocol's ``up``), or whose server reads single updates (its rule's
    dp_refusal: FedGF, FedWMSAM; the FedCM family's 1/tau_i when clients may take different
    step counts, local-steps = 0), is refused; every other runs under client-level DP."""
    refused = set()
    for name, spec in ALGORITHMS.items():
        values = {**spec.example_config(), **DP, "local-steps": steps}
        problems = compatibility_problems(RunConfig.from_mapping({**values, "dp.clip": 0.0}), spec)
        assert problems == []  # no DP, no clash
        try:
            RunConfig.from_mapping(values)
        except ConfigError as err:
            assert str(err).count("dp.clip > 0") == 1
            refused.add(name)
    own_steps = {"fedcm", "mofedsam", "fedtoga"} if steps == 0 else set()
    assert refused == {n for n, s in ALGORITHMS.items() if s.up} | {"fedgf", "fedwmsam"} | own_steps


def _calls(module: str, attribute: str) -> bool:
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    return any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == attribute
               for n in ast.walk(ast.parse(path.read_text())))


def test_one_setup_for_the_serverapp_and_the_preflight():
    """The ServerApp's run loop and the CLI's preflight both set a run up with prepare_run,
    and no other product module builds a strategy: the setup is written once."""
    assert _calls("flatflower.server.run", "prepare_run") and _calls("flatflower.tools.prepare", "prepare_run")
    builders = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                      for package in ("common", "client", "strategies", "server", "runtime", "tools")
                      for p in (ROOT / package).rglob("*.py")
                      if _calls(".".join(p.relative_to(ROOT).with_suffix("").parts), "new_strategy"))
    assert builders == ["flatflower.server.setup"]


def test_the_setup_the_preflight_runs_is_the_serverapps_own(tmp_path):
    """A checkpointed run resumed: prepare_run (what the preflight calls, and the ServerApp)
    starts after the checkpoint's round, from the strategy state and model the run saved."""
    import torch

    from flatflower.server.rundir import CHECKPOINT
    from flatflower.server.setup import prepare_run

    cfg = {"algorithm": "scaffold", "num-server-rounds": 2, "local-steps": 2, "tensorboard": False,
           "run-dir": str(tmp_path / "r"), "checkpoint-every": 1}
    run_dir, _ = run_inprocess(cfg, 3)
    resumed = RunConfig.from_mapping({**cfg, "num-partitions": 3, "num-server-rounds": 3, "resume": True})
    setup = prepare_run(resumed)
    saved = torch.load(run_dir / CHECKPOINT, weights_only=True)
    assert setup.first == 3
    state = setup.strategy.state_dict()
    assert state.keys() == saved["strategy"].keys()
    final = torch.load(run_dir / "model_final.pt", weights_only=True)
    assert all(torch.equal(setup.strategy.model[k], v) for k, v in final.items())
