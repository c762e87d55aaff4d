"""``stageserve up``: every service as its own OS process on one machine, supervised.

Start order follows the dependencies: tokenizer, vision encoder and decode first
(in parallel; with ``kv_store_gb`` the KV store's master too, ``kv_store_spec``, ready before
prefill starts), then prefill as soon as the encoder listens (it needs the encoder's address and
the master's; it loads its model while the encoder loads its own and waits for the encoder's
SERVING itself; once it is ready every rank must have lent the store its memory,
``check_store``), then the router (needs everyone ready).
Each child binds port 0 (its metrics port: ``metrics_port_base`` + its place in
``METRICS_PORT_ORDER`` when a base is given) and reports ``LISTENING`` / ``READY <name> port=...
metrics_port=...`` on stdout (``launch_child.Child``); the launcher waits for those lines
(bounded), then passes the addresses on, and prints every service's ports once all are ready
(``ready_table``).
A child that exits before it was ever ready fails start-up.

Once everything is up, the ``ChildSupervisor`` (``services.supervisor``) restarts a child that
exits (any code, any signal), or that it killed for answering no liveness check for
``liveness.timeout_s``, after a bounded exponential backoff, on the ports it had, so every
address the others hold stays valid (their channels reconnect by themselves), and rewrites
the state file when the new process is ready. The flags and ports each child
starts with are built in ``services.launch_spec``.

Children die with the launcher: they are asked for SIGTERM on the launcher's death
(``PR_SET_PDEATHSIG``), and on Ctrl-C / SIGTERM the launcher stops supervising, drains the
routers (SIGTERM: they refuse new requests and finish their streams, up to their drain budget
and the rest of their shutdown, ``router_stop_s``), then stops the workers in reverse start
order (SIGTERM, then SIGKILL after ``worker_stop_s``: decode and prefill drain too, within the
same budget), the KV store's master last (prefill's store clients close against it), so no
process outlives it. A second Ctrl-C /
SIGTERM cuts the drain short (the routers are killed). The children run in their own process
group, so a terminal's Ctrl-C reaches the launcher alone and the workers outlive the drain.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

from services.common.auth import child_environment
from services.common.errors import UnavailableError
from services.launch_child import Child, failure_lines, spawn_child
from services.launch_spec import (
    ChildSpec,
    LaunchConfig,
    common_args,
    decode_spec,
    encoder_spec,
    kv_store_address,
    kv_store_spec,
    port_args,
    prefill_spec,
    router_args,
    router_spec,
    router_stop_s,
    router_worker_specs,
    tokenizer_spec,
    worker_stop_s,
)
from services.prefill.kv_store_master import SERVICE as KV_STORE_SERVICE
from services.supervisor import ChildSupervisor

POLL_INTERVAL_S = 0.2


class StartInterrupted(Exception):
    """Ctrl-C / SIGTERM arrived while the services were starting."""


def new_run_dir() -> Path:
    """A fresh directory for one ``up``'s logs: <tmp>/stageserve-<date>-<time>-<pid>."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / f"stageserve-{stamp}-{os.getpid()}"


class Launcher:
    """Starts, restarts and stops the children; ``children`` is in start order."""

    def __init__(
        self,
        cfg: LaunchConfig,
        env: Mapping[str, str] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.cfg = cfg
        # Children's environment (ours + a new internal token by default): secrets go here,
        # not argv. Built once: a restarted child must get what the first one got (the same
        # token).
        self.env = dict(env) if env is not None else child_environment(os.environ)
        self.children: list[Child] = []
        self.stop = stop if stop is not None else threading.Event()  # set: start-up is abandoned
        self.hurry = threading.Event()  # set: stop_all kills the routers instead of draining

    def start(self, spec: ChildSpec) -> Child:
        child = self._spawn(spec, spec.ports)
        self.children.append(child)
        return child

    def restart(self, old: Child) -> Child:
        """Start ``old``'s service again on the ports ``old`` bound; it takes ``old``'s place."""
        child = self._spawn(old.spec, old.bound_ports())
        self.children[self.children.index(old)] = child
        return child

    def _spawn(self, spec: ChildSpec, ports: Mapping[str, int]) -> Child:
        # Called from the main thread only: PR_SET_PDEATHSIG fires when the forking thread ends.
        cmd = [
            sys.executable,
            "-m",
            spec.module,
            *common_args(self.cfg, spec.service or spec.name),
            *port_args(ports),
            *spec.args,
        ]
        return spawn_child(spec, ports, cmd, self.env, self.log_path(spec.name))

    def log_path(self, name: str) -> Path | None:
        return None if self.cfg.log_dir is None else self.cfg.log_dir / f"{name}.log"

    def log_hint(self, name: str) -> str:
        path = self.log_path(name)
        return "" if path is None else f" (log: {path})"

    def why(self, name: str) -> str:
        """The end of ``name``'s log, indented, for the console: the real cause of a failure."""
        path = self.log_path(name)
        lines = [] if path is None else failure_lines(path)
        return "".join(f"\n    {line}" for line in lines)

    def wait_ready(self, children: list[Child], *, listening: bool = False) -> None:
        """Until every child printed READY (``listening``: LISTENING or READY); raises when one
        exits first, on the ready timeout, or when start-up is abandoned."""
        deadline_mono = time.monotonic() + self.cfg.ready_timeout_s
        is_up = (lambda c: c.ready or c.listening) if listening else (lambda c: c.ready)
        while not all(is_up(c) for c in children):
            if self.stop.is_set():  # checked first: a Ctrl-C also stops the children themselves
                raise StartInterrupted()
            for c in children:
                if not is_up(c) and c.process.poll() is not None:
                    raise UnavailableError(
                        f"{c.name} exited with code {c.process.returncode} before it was ready"
                        + self.log_hint(c.name)
                        + self.why(c.name)
                    )
            if time.monotonic() > deadline_mono:
                late = [c.name for c in children if not is_up(c)]
                timeout_s = self.cfg.ready_timeout_s
                raise UnavailableError(f"not ready after {timeout_s:.0f} s: {', '.join(late)}")
            time.sleep(0.05)

    def start_all(self) -> Child:
        cfg = self.cfg
        store_spec = kv_store_spec(cfg)
        store = self.start(store_spec) if store_spec is not None else None  # first: stops last
        tokenizer = self.start(tokenizer_spec(cfg))
        encoder = self.start(encoder_spec(cfg))
        decode = self.start(decode_spec(cfg))
        if store is not None:
            self.wait_ready([store])
        # prefill loads its model while the encoder loads its own: it needs only its address
        self.wait_ready([encoder], listening=True)
        store_address = "" if store is None else kv_store_address(store.ready["master_port"])
        prefill = self.start(prefill_spec(cfg, encoder.address, store_address))
        self.wait_ready([tokenizer, encoder, decode, prefill])
        if store is not None:
            self.check_store(store)
        args = router_args(
            cfg,
            tokenizer=tokenizer.address,
            prefill=prefill.address,
            decode=decode.address,
            encoder=encoder.address,
        )
        router = self.start(router_spec(cfg, args))
        self.wait_ready([router])
        http_port = int(router.ready["http_port"])  # the others share it (SO_REUSEPORT)
        others = [self.start(spec) for spec in router_worker_specs(cfg, args, http_port)]
        self.wait_ready(others)
        self.write_state()
        return router

    def check_store(self, store: Child) -> None:
        """Every prefill rank lent the KV store its ``kv_store_gb`` (a rank that could not
        connect logs why and serves without the tier): ``UnavailableError`` otherwise."""
        from services.prefill.kv_store_master import lent_bytes

        expected = self.cfg.prefill_ranks * int(self.cfg.kv_store_gb * 1e9)
        try:
            lent = lent_bytes(int(store.ready["metrics_port"]))
        except OSError as exc:
            raise UnavailableError(f"the KV store's master does not answer: {exc}") from exc
        if lent < expected:
            raise UnavailableError(
                f"prefill's ranks lent the KV store {lent} of {expected} bytes: a rank could "
                "not connect (its log says why: 'no KV store on this rank')"
                + self.log_hint("prefill")
            )

    def write_state(self) -> None:
        """Pids and ports of the current children as JSON, replaced atomically (no reader sees
        half a file)."""
        if self.cfg.state_file is None:
            return
        state = {c.name: {"pid": c.process.pid, **c.ready} for c in self.children}
        config = json.loads(json.dumps(asdict(self.cfg), default=str))
        state["launcher"] = {"pid": os.getpid(), "config": config}
        partial = self.cfg.state_file.with_name(self.cfg.state_file.name + ".partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(self.cfg.state_file)

    @staticmethod
    def kill(child: Child) -> None:
        child.process.kill()
        child.process.wait()

    def stop_all(self) -> None:
        """Drain the routers (SIGTERM, up to ``router_stop_s``, less once ``hurry`` is set),
        then SIGTERM the workers in reverse start order, wait for each up to its
        ``worker_stop_s``; SIGKILL what is left."""
        routers = [c for c in self.children if c.service == "router"]
        stores = [c for c in self.children if c.service == KV_STORE_SERVICE]
        workers = [
            c for c in reversed(self.children) if c.service not in ("router", KV_STORE_SERVICE)
        ]
        if any(c.process.poll() is None for c in routers):
            print(
                f"draining the routers (up to {router_stop_s(self.cfg):g} s; Ctrl-C again stops "
                "them at once)",
                file=sys.stderr,
                flush=True,
            )
        self._stop(routers, lambda c: router_stop_s(self.cfg), self.hurry)
        self._stop(workers, lambda c: worker_stop_s(self.cfg, c.service))
        self._stop(stores, lambda c: self.cfg.stop_grace_s)  # once prefill closed its clients
        if self.cfg.gpu_share_file is not None:  # prefill's and decode's, both stopped
            self.cfg.gpu_share_file.unlink(missing_ok=True)

    def _stop(
        self,
        children: list[Child],
        stop_s: Callable[[Child], float],
        hurry: threading.Event | None = None,
    ) -> None:
        for c in children:
            if c.process.poll() is None:
                c.process.send_signal(signal.SIGTERM)
        start_mono = time.monotonic()
        for c in children:
            deadline_mono = start_mono + stop_s(c)
            while c.process.poll() is None and time.monotonic() < deadline_mono:
                if hurry is not None and hurry.is_set():
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.process.wait(
                        timeout=min(POLL_INTERVAL_S, max(0.0, deadline_mono - time.monotonic()))
                    )
            if c.process.poll() is None:
                self.kill(c)


def ready_table(host: str, children: list[Child]) -> list[str]:
    """The lines ``up`` prints once every service is ready: each one's pid, gRPC port and
    ``/metrics`` address (the router's also its HTTP port)."""
    lines = [f"  {'service':<15} {'pid':>8} {'grpc':>6}  metrics"]
    for c in children:
        http = f"  (HTTP port {c.ready['http_port']})" if "http_port" in c.ready else ""
        metrics = f"http://{host}:{c.ready.get('metrics_port', '?')}/metrics"
        grpc = c.ready.get("port", "?")
        lines.append(f"  {c.name:<15} {c.process.pid:>8} {grpc:>6}  {metrics}{http}")
    return lines


def run_up(cfg: LaunchConfig, env: Mapping[str, str] | None = None) -> int:
    stop = threading.Event()
    launcher = Launcher(cfg, env, stop)

    def on_signal(*_: object) -> None:
        if stop.is_set():
            launcher.hurry.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if cfg.log_dir is not None:
        print(f"logs: {cfg.log_dir}", flush=True)
    try:
        router = launcher.start_all()
        http_port = router.ready.get("http_port")
        print(f"stageserve is up: OpenAI API at http://{cfg.host}:{http_port}/v1", flush=True)
        for line in ready_table(cfg.host, launcher.children):
            print(line, flush=True)
        supervisor = ChildSupervisor(launcher, stop)
        try:
            while not stop.wait(POLL_INTERVAL_S):
                supervisor.poll()
        finally:
            supervisor.close()
        return 0
    except StartInterrupted:
        print("interrupted while starting: stopping the services", file=sys.stderr, flush=True)
        return 130
    except UnavailableError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop_all()
