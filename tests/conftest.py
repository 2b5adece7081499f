"""Shared test setup.

* Flower is kept offline and away from ``~/.flwr``: ``FLWR_HOME`` points at a temporary
  directory, update checks and telemetry are off. This runs at import time, i.e. before any
  test module imports ``flwr``. The record key that seals run directories
  (``FLATFLOWER_RECORD_KEY``) is made in that directory too, never in the user's home.
* :func:`fast_config` - run-config keys for a run that takes well under a second per round.
* ``make_message`` - a fixture that builds Flower ``Message`` objects outside a Flower
  runtime (Flower needs a task identity for that).
* ``make test`` runs on two pytest-xdist workers. Each pytest process tags what it starts
  with its own ``FLATFLOWER_TEST_PROCESS`` environment value, and ``flower_pids`` counts only
  the Flower processes carrying it, so a worker never sees the other's processes; ports come
  from a ledger that no two federations share (flatflower.runtime.engines.federation.free_port), so deployments run
  side by side. The Ray tests form one xdist group, ``ray``: one Ray cluster at a time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

import pytest

_FLWR_HOME = tempfile.mkdtemp(prefix="flatflower-tests-flwr-home-")
os.environ["FLWR_HOME"] = _FLWR_HOME
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLATFLOWER_TEST_PROCESS"] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
# the record key that seals run directories (server/recordkey.py): this session's, never the user's own
os.environ["FLATFLOWER_RECORD_KEY"] = os.path.join(_FLWR_HOME, "flatflower", "record.key")


@pytest.fixture(autouse=True, scope="session")
def _flower_home():
    """Keep the environment above for the whole session; remove the directory afterwards."""
    yield _FLWR_HOME
    shutil.rmtree(_FLWR_HOME, ignore_errors=True)


def set_task_identity() -> None:
    """Give this process the task identity Flower requires to construct a Message."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0


@pytest.fixture
def make_message():
    """``make_message(content, dst_node_id=1, message_type="train")`` -> a new Message."""
    from flwr.app import Message, MessageType, RecordDict

    set_task_identity()

    def make(content: RecordDict | None = None, dst_node_id: int = 1,
             message_type: str = MessageType.TRAIN, group_id: str = "1") -> Message:
        return Message(content if content is not None else RecordDict(), dst_node_id=dst_node_id,
                       message_type=message_type, group_id=group_id)

    return make


def _xdist_group(item: pytest.Item) -> str | None:
    return "ray" if item.get_closest_marker("ray") is not None else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The xdist groups of the tests that must not run beside each other (see above)."""
    for item in items:
        if group := _xdist_group(item):
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    """Fail loudly, not flakily, if pytest-xdist did not apply the groups (see pyproject.toml)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        lost = [i.nodeid for i in session.items
                if (group := _xdist_group(i)) and not i.nodeid.endswith(f"@{group}")]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {lost[0]}: use pytest < 9")


# ---------------------------------------------------------------- spies on the server halves
@pytest.fixture
def server_spy(monkeypatch):
    """Wraps the FedDyn-family server update (FedSpeed, FedGMT, FedTOGA call it through
    super()) to record the server rule and, per round, u computed independently in float64 with
    uniform weights, and the number of clients M."""
    from flatflower.strategies.feddyn import FedDyn
    from tests.reference import Problem

    seen = {"rule": None, "u_uniform": [], "M": []}
    original = FedDyn.update

    def spy(self, server_round, updates, weights):
        start = Problem.flat(v.double().numpy() for v in self.model.values())
        models = [Problem.flat(v.double().numpy() for v in up.model.values()) for up in updates]
        seen["rule"] = self
        seen["u_uniform"].append(sum(m - start for m in models) / len(models))
        seen["M"].append(len(updates))
        return original(self, server_round, updates, weights)

    monkeypatch.setattr(FedDyn, "update", spy)
    return seen


@pytest.fixture
def strategy_spy(monkeypatch):
    """Records the strategy of the last run (to read its server state)."""
    from flatflower.strategies.strategy import FlatStrategy

    seen = {}
    original = FlatStrategy.finish_round

    def spy(self, server_round, updates):
        seen["strategy"] = self
        return original(self, server_round, updates)

    monkeypatch.setattr(FlatStrategy, "finish_round", spy)
    return seen
