"""A warm ClientApp worker for one SuperNode (``flower-supernode --isolation process``).

Flower's default, ``--isolation subprocess``, has each SuperNode start a SuperExec that starts
a new ``flwr-clientapp`` process for every message: Python, flwr and torch are imported again
each time (about 3 s of CPU per message on a small CPU). The worker is that SuperExec loop and
that ClientApp process in one long-lived process, built from Flower's own runtime functions:
it acquires the SuperNode's tasks from its Runtime API, pulls each task's message, context and
FAB, runs the ClientApp in this process and pushes the reply and the context back, as
``flwr-clientapp`` does. Client state is Flower's: ``context.state`` goes back to the
SuperNode with the task's output, and a failed call's error reply carries its exception's type
and message.

One worker hosts one FAB's code (modules are imported once): a task of another FAB (a new run
with other code) runs in a fresh ``flwr-clientapp`` process, and the worker then exits so its
supervisor starts a fresh worker with the new code.

``flatflower-worker`` is that supervisor: it restarts the worker whenever it exits (a crash, a
ClientApp that calls ``os._exit``, a new FAB), and ends when the SuperNode it serves ends
(``--parent-pid``). In docker compose the restart policy does the same for the container.

    flatflower-worker --runtime-api-address 127.0.0.1:9094 [--insecure] [--parent-pid PID] \
        [--superexec-auth-secret-file FILE]

With ``--superexec-auth-secret-file`` (the file the SuperNode got under the same flag) the
worker and its SuperNode authenticate each other, so that no other user of the machine can take
the node's tasks or hand it false ones (runtime/appauth.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from logging import ERROR, INFO

from flatflower.runtime import appauth
from flatflower.runtime.args import Parser
from flatflower.runtime.deadline import GaveUp, MovedOn, Watchdog, expired_reason, seconds_left

WORKER_EXIT_NEW_FAB = 3  # the worker exits to load another FAB's code (not an error)
WORKER_EXIT_ABANDONED = 4  # the worker exits to drop a task past its deadline (not an error)
REASON_CHARS = 1000  # how much of an exception an error reply carries


def error_reason(err: BaseException) -> str:
    """``<class 'T'>:<'message'>`` as Flower's runtime writes it, bounded and without control
    characters (a reply's text ends up on the operator's screen)."""
    text = f"{type(err)}:<'{err}'>"
    return re.sub(r"[\x00-\x1f\x7f]+", " ", text)[:REASON_CHARS]


class Worker:
    """The task loop of one SuperNode (see the module docstring)."""

    def __init__(self, address: str, insecure: bool, root_certificates: bytes | None, poll: float,
                 secret: bytes | None = None):
        self.address, self.insecure, self.root_certificates = address, insecure, root_certificates
        self.poll = poll
        self.secret = secret  # signs the requests that hand out tasks (runtime/appauth.py)
        self.fab_hash: str | None = None  # the FAB whose code this process hosts
        self.app = None

    def client(self, *interceptors):
        """A Runtime API client with Flower's retries, each of which says the address it tries."""
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient

        retry = make_simple_http_retry_invoker()

        def wait(seconds: float) -> None:  # Flower's says "Connection attempt failed" only
            say(f"cannot reach the SuperNode's Runtime API at {self.address}; retrying in "
                f"{seconds:.1f} s")
            time.sleep(seconds)

        retry.wait_function = wait
        return RuntimeHttpClient.from_server_address(
            server_address=self.address, insecure=self.insecure,
            root_certificates=self.root_certificates, interceptors=list(interceptors),
            retry_invoker=retry)

    def serve(self) -> int:
        """Acquire and run tasks until a task of another FAB has run (then exit to reload)."""
        from flwr.proto.runtime_pb2 import (AcquireTaskRequest,  # pylint: disable=E0611
                                            PullPendingTasksRequest)
        from flwr.supercore.constant import TaskType
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

        auth = [appauth.interceptor(self.secret)] if self.secret else []
        client = self.client(RuntimeVersionHttpInterceptor(component_name="SuperExec"), *auth)
        connected = False
        try:
            while True:
                res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
                if not connected:
                    say(f"connected to the SuperNode's Runtime API at {self.address}")
                    connected = True
                if res.HasField("task") and res.token:
                    appauth.check_listener(self.address)  # the SuperNode is our user's
                    if res.task.fab_hash and self.fab_hash not in (None, res.task.fab_hash):
                        self.cold(res.token)
                        return WORKER_EXIT_NEW_FAB
                    self.run_task(res.token, MovedOn(res.task, lambda: list(
                        client.PullPendingTasks(PullPendingTasksRequest()).tasks)))
                else:
                    time.sleep(self.poll)
        finally:
            client.close()

    def cold(self, token: str) -> None:
        """Run one task in a fresh ``flwr-clientapp`` process (another FAB's code). Its token
        goes in a private file, not on the command line, which every user can read in ``ps``."""
        with tempfile.TemporaryDirectory(prefix="flatflower-token-") as private:  # mode 0700
            token_file = os.path.join(private, "token")
            with os.fdopen(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as out:
                out.write(token)
            cmd = ["flwr-clientapp", "--runtime-api-address", self.address, "--token-file",
                   token_file, "--parent-pid", str(os.getpid())]
            cmd += ["--insecure"] if self.insecure else []
            subprocess.run(cmd, check=False)

    def run_task(self, token: str, moved_on: MovedOn | None = None) -> None:
        """One task: pull its input, run the ClientApp here, push the reply and the context
        (``moved_on``: drops the task if the SuperNode gave up its message, runtime/deadline.py)."""
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore import log
        from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
        from flwr.supercore.interceptors import (RuntimeTokenHttpInterceptor,
                                                 RuntimeVersionHttpInterceptor)
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        client = self.client(RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                             RuntimeTokenHttpInterceptor(token))
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            message, context, run, fab = pull_task_input(client, moved_on)
            if (left := seconds_left(message)) <= 0:  # nobody waits for it: drop it at once
                raise TaskExpired(expired_reason(message, left))
            watchdog = Watchdog(left, lambda: self.abandon(token, message)).start()
            try:
                reply = self.load(run, fab)(message=message, context=context)
            finally:
                if not watchdog.claim():  # the deadline came first: the watchdog answers, exits
                    threading.Event().wait()
            status, details = SubStatus.COMPLETED, ""
        except GaveUp as err:  # nobody waits for a reply: none is sent
            say(str(err))
            details, context = str(err), None
        except TaskExpired as err:
            say(str(err))
            details = str(err)
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                            reply_to=message)
            context = None  # the client's state stays as it was
        except Exception as err:  # noqa: BLE001 - as flwr-clientapp: an error reply
            log(ERROR, "ClientApp raised an exception", exc_info=err)
            details = error_reason(err)
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                                reply_to=message)
        finally:
            try:
                if reply is not None:
                    try:
                        push_message(client, reply, context or _ReplyContext(message))
                    except Exception as err:  # noqa: BLE001 - e.g. the SuperNode ended the task
                        say(f"could not send the reply: {error_reason(err)[:200]}")
                push_task_output(client=client, context=context, sub_status=status, details=details)
            finally:
                heartbeat.stop()
                client.close()
        log(INFO, "task done: %s", status)

    def abandon(self, token: str, message) -> None:
        """The deadline of the running task passed (runtime/deadline.py): answer it with an
        error reply, leave the client's state as it was, and end this process (its supervisor
        starts a fresh worker at once), so that the SuperNode takes its next message now."""
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.supercore.interceptors import (RuntimeTokenHttpInterceptor,
                                                 RuntimeVersionHttpInterceptor)
        from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

        details = expired_reason(message, seconds_left(message)).replace("not run", "abandoned", 1)
        say(details)
        try:
            client = self.client(RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                                 RuntimeTokenHttpInterceptor(token))
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details),
                            reply_to=message)
            push_message(client, reply, _ReplyContext(message))
            push_task_output(client=client, context=None, sub_status=SubStatus.FAILED, details=details)
        finally:
            os._exit(WORKER_EXIT_ABANDONED)

    def load(self, run, fab):
        """The ClientApp of ``fab``, installed and imported once per process."""
        if self.app is None:
            from flwr.cli.install import install_from_fab
            from flwr.clientapp.utils import get_load_client_app_fn

            install_from_fab(fab.content, skip_prompt=True)
            self.app = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)(
                run.fab_id, run.fab_version, fab.hash_str)
            self.fab_hash = fab.hash_str
        return self.app


class TaskExpired(Exception):
    """The task's message expired before it ran (runtime/deadline.py)."""


class _ReplyContext:
    """What ``push_message`` reads of a context (its node and run), for a reply pushed
    without the task's context (the client's state is not pushed with it)."""

    def __init__(self, message):
        self.node_id, self.run_id = message.metadata.dst_node_id, message.metadata.run_id


def say(text: str) -> None:
    """One line of the worker's own on its standard error."""
    print(f"flatflower-worker: {text}", file=sys.stderr, flush=True)


def pull_task_input(client, moved_on: MovedOn | None = None):
    """(message, context, run, fab) of the acquired task: Flower's ``pull_task_input`` with
    short object-pull backoffs (a parameter of Flower's own pull function); while an object is
    missing, ``moved_on.check()`` may give up (runtime/deadline.py)."""
    from flwr.common.serde import context_from_proto, fab_from_proto, run_from_proto
    from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
    from flwr.proto.runtime_pb2 import (PullAppMessagesRequest,  # pylint: disable=E0611
                                        PullTaskInputRequest)
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf, make_pull_object_fn_protobuf)
    from flwr.supercore.inflatable.inflatable_utils import (ObjectUnavailableError,
                                                            pull_and_inflate_object_from_tree)
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = (
        res.task_id, res.run.run_id, res.context.node_id)
    context, run, fab = context_from_proto(res.context), run_from_proto(res.run), fab_from_proto(res.fab)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    pull = make_pull_object_fn_protobuf(client.PullObject, node, context.run_id)

    def pull_or_give_up(object_id: str) -> bytes:
        try:
            return pull(object_id)
        except ObjectUnavailableError:  # not (yet) received by the SuperNode
            if moved_on is not None:
                moved_on.check()
            raise

    message = pull_and_inflate_object_from_tree(
        tree, pull_or_give_up,
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, initial_backoff=0.05, backoff_cap=1.0)
    message.metadata.__dict__["_message_id"] = tree.object_id
    return message, context, run, fab


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="flatflower-worker", description=(
        "A warm ClientApp worker for one SuperNode started with --isolation process: it runs "
        "the SuperNode's ClientApp tasks in one long-lived process (restarted when it exits)."))
    p.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                   help="the SuperNode's Runtime API (its --host/--port; default 127.0.0.1:9094)")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API")
    tls.add_argument("--root-certificates", help="CA certificate of the Runtime API's TLS")
    p.add_argument("--parent-pid", type=int, help="end when this process (the SuperNode) ends")
    p.add_argument("--superexec-auth-secret-file", metavar="FILE", help=(
        "the secret the SuperNode got under the same flag (flower-supernode --isolation process "
        "--superexec-auth-secret-file FILE): only a worker that knows it is handed tasks"))
    p.add_argument("--create-secret", metavar="FILE", help=(
        "write a new random secret to FILE (mode 0600; kept if FILE is already a private secret) "
        "and exit"))
    p.add_argument("--supervisor-pid", type=int, help=argparse.SUPPRESS)  # set by the supervisor
    p.add_argument("--poll", type=float, default=0.1, help="seconds between task polls (default 0.1)")
    p.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # the supervised child
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.create_secret:
        try:
            made = appauth.create_secret(args.create_secret)
        except (OSError, appauth.AppAuthError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        say(f"{'wrote a new' if made else 'kept the'} secret {args.create_secret}")
        return 0
    if not args.insecure and not args.root_certificates:
        print("error: give --insecure (plain HTTP on loopback) or --root-certificates",
              file=sys.stderr)
        return 2
    if args.superexec_auth_secret_file:
        try:
            appauth.read_secret(args.superexec_auth_secret_file)
        except appauth.AppAuthError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    elif not args.once:
        say("no --superexec-auth-secret-file: any user of this machine who can reach the "
            "Runtime API can take this node's tasks (see docs/deployment.md)")
    if args.once:
        return child(args)
    return supervise(args, sys.argv[1:] if argv is None else argv)


def child(args: argparse.Namespace) -> int:
    from flwr.supercore.app_utils import start_parent_process_monitor

    for pid in (args.supervisor_pid, args.parent_pid):  # never outlive either
        if pid:
            start_parent_process_monitor(pid)
    import torch  # noqa: F401 - imported once, before the first task, as the point of the worker

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where the worker is, on its stderr

    certificates = open(args.root_certificates, "rb").read() if args.root_certificates else None
    secret = (appauth.read_secret(args.superexec_auth_secret_file)
              if args.superexec_auth_secret_file else None)
    try:
        return Worker(args.runtime_api_address, args.insecure, certificates, args.poll, secret).serve()
    except appauth.AppAuthError as err:  # an impostor on the Runtime API's port: no task taken
        say(f"error: {err}")
        return 1


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the worker; start it again whenever it exits, until the SuperNode is gone or a
    SIGTERM / SIGINT arrives (``docker stop``: the supervisor is the container's PID 1, which
    ignores signals it does not handle), which it passes on to the worker before exiting 0."""
    stopping: list[int] = []  # a plain flag: a signal handler must not take locks
    worker: list[subprocess.Popen] = []

    def on_signal(signum, frame):
        stopping.append(signum)
        if worker and worker[-1].poll() is None:
            worker[-1].terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    failures = 0
    while not stopping:
        started = time.monotonic()
        worker[:] = [subprocess.Popen([sys.executable, "-m", "flatflower.runtime.worker", *argv, "--once",
                                       "--supervisor-pid", str(os.getpid())])]
        if stopping:  # a signal between the check above and the start
            worker[-1].terminate()
        code = worker[-1].wait()
        if stopping or (args.parent_pid and not _alive(args.parent_pid)):
            return 0
        planned = code in (WORKER_EXIT_NEW_FAB, WORKER_EXIT_ABANDONED)
        failures = 0 if planned or time.monotonic() - started > 60 else failures + 1
        say(f"worker exited with code {code}; restarting")
        pause_until = time.monotonic() + (0.0 if planned else min(10.0, 0.5 * 2 ** min(failures, 5)))
        while not stopping and time.monotonic() < pause_until:
            time.sleep(0.1)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(main())
