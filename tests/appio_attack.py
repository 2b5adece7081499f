"""Another user of a node's machine tries to act as the node's ClientApp (issue 44, item 5).

    python -m tests.appio_attack RUNTIME_API_ADDRESS SECONDS OUT.json [FORGED_SECRET_HEX]

Once OUT.json.go exists, for SECONDS (or until OUT.json.stop exists) it asks the SuperNode's
Runtime API for tasks as Flower's own SuperExec does (``AcquireTask``, unsigned, or signed with a
guessed secret), ten times as often as the warm worker polls, so that it wins most races.
For every task it is given it reads the task's input (the round's message, with the global
model) and then answers it as failed, so the genuine node's round fails. It writes what it got
to OUT.json: ``tasks`` (tokens obtained), ``models_read``, ``failed_pushed``, ``refused`` (how
many requests the Runtime API refused) and the distinct ``errors`` it saw. Run by
tests/test_appauth.py as another uid (``setpriv --reuid 65534``).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(address: str, seconds: float, out: str, forged: str | None = None) -> None:
    from flwr.common.constant import SubStatus
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.runtime import RuntimeHttpClient

    from flwr.supernode.runtime.run_clientapp import push_task_output

    from flatflower.runtime import appauth
    from flatflower.runtime.worker import pull_task_input

    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if forged:
        interceptors.append(appauth.interceptor(bytes.fromhex(forged)))
    client = RuntimeHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None, interceptors=interceptors)
    seen = {"tasks": 0, "models_read": 0, "failed_pushed": 0, "refused": 0, "requests": 0, "errors": []}
    while not os.path.exists(out + ".go") and not os.path.exists(out + ".stop"):
        time.sleep(0.01)  # imported and ready: the test says when to start
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not os.path.exists(out + ".stop"):
        seen["requests"] += 1
        try:
            res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except Exception as err:  # noqa: BLE001 - refused or unreachable: what we record
            seen["refused"] += 1
            text = f"{type(err).__name__}: {err}"[:300]
            if text not in seen["errors"]:
                seen["errors"].append(text)
            time.sleep(0.01)
            continue
        if not (res.HasField("task") and res.token):
            time.sleep(0.01)
            continue
        seen["tasks"] += 1
        stolen = RuntimeHttpClient.from_server_address(
            server_address=address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                          RuntimeTokenHttpInterceptor(res.token)])
        try:
            message, context, _, _ = pull_task_input(stolen)  # the worker's own reader
            seen["models_read"] += sum(arrays.count_bytes() > 0 for arrays in message.content.array_records.values())
            push_task_output(client=stolen, context=context, sub_status=SubStatus.FAILED,
                             details="<class 'PermissionError'>:<'taken by another user'>")
            seen["failed_pushed"] += 1
        except Exception as err:  # noqa: BLE001
            seen["errors"].append(f"after taking a task: {type(err).__name__}: {err}"[:300])
        finally:
            stolen.close()
    client.close()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3], *(sys.argv[4:5]))
