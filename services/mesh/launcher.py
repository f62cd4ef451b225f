"""Start, supervise and stop the mesh's service processes (used by `make up` and the e2e tests).

Internal services bind port 0 and report the bound port through a port file, so nothing
collides and nobody guesses ports; the gateway takes the public ports it is given. A supervised
mesh (`run_forever`, or `MeshConfig.supervise`) restarts a child that exits, on the ports it
had (peers hold its address), as `services/mesh/supervision.py` decides.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common import roles
from services.common.grpc_util import channel
from services.common.pki import ensure_pki
from services.common.security import Identity, load_identity
from services.common.server import wait_for_serving
from services.common.waiting import wait_for
from services.mesh import netns, topology
from services.mesh.supervision import ChildHistory, GiveUp, RestartPolicy, decide, describe_exit
from services.model_format.default_model import DEFAULT_MODEL_ID


@dataclass
class MeshConfig:
    """What to start. Colocated by default: `workers` processes, `initial_instances` of them
    loaded. With `prefill` and `decode` (both > 0) the model is served disaggregated: the first
    `prefill` workers start as prefill workers, the next `decode` as decode workers, and the
    manager keeps those pools loaded; `workers` is then raised to at least prefill + decode (more
    stay IDLE for the autoscaler) and `initial_instances` is not used."""

    workers: int = 2
    prefill: int = 0
    decode: int = 0
    host_caches: int = 1
    model: str = DEFAULT_MODEL_ID
    model_dir: Path = Path("models")
    run_dir: Path = Path("run")
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    initial_instances: int = 2
    # torch threads per worker; 0 = each its share of the cores (`worker_thread_args`). Meshes
    # built in code keep 1 so tests with several busy workers do not oversubscribe the cores.
    worker_threads: int = 1
    ready_timeout_s: float = 300.0
    # Autoscaling (`autoscale`: the manager's HeteroScale policy with `policy_params`, bounded by
    # the workers started) and the gateway's wait for a route. Off/unset here, so meshes built
    # in code (tests, benchmarks) keep passing what they mean; `make up`'s CLI turns them on.
    autoscale: bool = False
    policy_params: dict[str, Any] = field(default_factory=dict)
    window_s: float | None = None
    schedule_wait_s: float | None = None
    worker_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    manager_args: list[str] = field(default_factory=list)
    log_to_files: bool = True
    # Restart children that exit once the mesh is up (`run_forever` always does).
    supervise: bool = False
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Network-namespace hosts (needs root): every worker and host cache on its own emulated host
    # behind a `tc tbf` uplink of this many Mbit/s (services/mesh/netns.py); the manager and the
    # gateway stay in this namespace, which joins the hosts' switch unshaped. None: all on
    # loopback, unshaped.
    netns_rate_mbit: float | None = None
    # mTLS on every internal hop: a local CA and a certificate per role in `tls_dir` (default
    # run_dir/tls), made on the first start. `insecure` (development only) runs every internal
    # service plaintext with no caller checks instead.
    tls_dir: Path | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or (self.prefill > 0) != (self.decode > 0):
            raise ValueError(
                f"prefill={self.prefill!r} and decode={self.decode!r}: give both > 0 (disaggregated) "
                "or both 0 (colocated)"
            )
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers!r}")
        if self.schedule_wait_s is not None and self.schedule_wait_s < 0:
            raise ValueError(f"schedule_wait_s must be >= 0, got {self.schedule_wait_s!r}")
        if self.netns_rate_mbit is not None and not self.netns_rate_mbit > 0:
            raise ValueError(f"netns_rate_mbit must be > 0, got {self.netns_rate_mbit!r}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 and self.decode > 0

    @property
    def worker_count(self) -> int:
        """Worker processes to start."""
        return max(self.workers, self.prefill + self.decode) if self.disaggregated else self.workers

    def worker_role(self, i: int) -> str:
        """The role worker i starts with (the manager gives each pool the workers started for it)."""
        if not self.disaggregated:
            return "colocated"
        return "prefill" if i < self.prefill else "decode" if i < self.prefill + self.decode else "colocated"

    @property
    def steady_instances(self) -> int:
        """Instances that compute from the start: the pools kept loaded."""
        return self.prefill + self.decode if self.disaggregated else self.initial_instances

    def worker_thread_args(self) -> list[str]:
        """How a worker picks its engine's torch threads: `worker_threads` fixed, or with 0 its
        share of the machine's cores among the engines running there now (`--cpu-share-dir`).

        One instance on all the cores serves at about twice the speed of one on half of them,
        and two instances that each take all the cores at once decode at a third of the speed
        of two that split them (OpenMP's waiting threads spin): so the default mesh's single
        loaded instance gets every core, and instances the autoscaler adds split them.
        """
        return topology.worker_thread_args(
            threads=self.worker_threads, cpu_share_dir=str((self.run_dir / "cpu-share").resolve())
        )

    @property
    def tls_path(self) -> Path:
        return self.tls_dir if self.tls_dir is not None else self.run_dir / "tls"

    def security_args(self) -> list[str]:
        """What every child is started with: its certificates' directory, or the plaintext opt-in."""
        return topology.security_args(None if self.insecure else str(self.tls_path.resolve()))

    def manager_pool_args(self) -> list[str]:
        """The manager's pool floors: what it keeps loaded from the IDLE workers."""
        if self.disaggregated:
            return topology.manager_pool_args(
                min_instances="0", min_prefill=str(self.prefill), min_decode=str(self.decode)
            )
        return topology.manager_pool_args(min_instances=str(self.initial_instances))

    def manager_autoscale_args(self) -> list[str]:
        """The manager's autoscaling flags: the policy may grow each pool up to the workers started."""
        if not self.autoscale:
            return []
        return topology.manager_autoscale_args(
            policy_params=topology.policy_params_json(self.policy_params),
            max_instances=str(max(1, self.worker_count)),
            window_s=str(self.window_s) if self.window_s is not None else None,
        )

    def gateway_wait_args(self) -> list[str]:
        return topology.schedule_wait_args(None if self.schedule_wait_s is None else str(self.schedule_wait_s))

    def serving_wanted(self) -> dict[str, int]:
        """SERVING instances per role (SDK role names) that make the mesh ready."""
        if self.disaggregated:
            return {"prefill": self.prefill, "decode": self.decode}
        return {"any": self.initial_instances}


@dataclass
class Proc:
    name: str
    process: asyncio.subprocess.Process
    port_file: Path
    module: str = ""
    args: list[str] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)
    started_s: float = 0.0  # the event loop's clock when the process was spawned
    host: str = "127.0.0.1"  # the address its gRPC server binds (an emulated host's, in netns)
    netns: str | None = None  # the network namespace it runs in (None: this one)

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.ports['grpc_port']}"


class Mesh:
    """The processes of one mesh. `start()` returns when everything serves; `stop()` ends all."""

    def __init__(self, cfg: MeshConfig) -> None:
        self.cfg = cfg
        self.procs: dict[str, Proc] = {}
        # Instance id -> role of the SERVING instances when the mesh became ready (for the banner).
        self.roles: dict[str, str] = {}
        # Held while a child is replaced, so the supervisor and restart() never both respawn it.
        self._replacing: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        # Ends with the reason when a child cannot be kept running; None until supervision starts.
        self.supervisor: asyncio.Task[str] | None = None
        # Set the moment a stop is asked for: children exiting from then on are not restarted
        # (Ctrl-C reaches the whole process group, so they may exit before stop() runs).
        self.stopping = False
        self.network: netns.ShapedNetwork | None = None  # the emulated hosts (cfg.netns_rate_mbit)
        self._tls_ready = False

    @property
    def gateway_http(self) -> str:
        return f"http://{self.cfg.host}:{self.procs['gateway'].ports['http_port']}"

    @property
    def gateway_grpc(self) -> str:
        return f"{self.cfg.host}:{self.procs['gateway'].ports['grpc_port']}"

    def placement(self, name: str) -> tuple[str | None, str]:
        """(network namespace, bind address) of process `name`: worker i on emulated host i,
        host caches (the parameter manager first) on the hosts after the workers', the manager
        and the gateway here, the manager on this namespace's address on the switch, the gateway
        on the public address it is given."""
        net = self.network
        if name == "gateway":
            return None, self.cfg.host
        if net is None:
            return None, "127.0.0.1"
        hosts = net.hosts
        if name.startswith("worker-"):
            h = hosts[int(name.split("-", 1)[1])]
        elif name == "param_manager" or name.startswith("host_cache-"):
            slot = 0 if name == "param_manager" else int(name.split("-", 1)[1])
            h = hosts[self.cfg.worker_count + slot]
        else:
            assert net.plan.root_address is not None
            return None, net.plan.root_address
        return h.netns, h.address

    async def ensure_tls(self, name: str | None = None) -> None:
        """The mesh's CA and role certificates, made on its first start (kept after, renewed
        when they near their end), and the own certificate of the instance process `name` is
        (a worker, a host cache) before it starts; nothing --insecure."""
        if self.cfg.insecure:
            return
        instance = instance_of(name) if name is not None else None
        if self._tls_ready and instance is None:
            return
        made = await asyncio.to_thread(ensure_pki, self.cfg.tls_path, instances=[instance] if instance else [])
        if made:
            print(f"blitzmesh: made {', '.join(made)} in {self.cfg.tls_path}/", file=sys.stderr)
        self._tls_ready = True

    async def spawn(self, name: str, module: str, args: list[str]) -> Proc:
        await self.ensure_tls(name)
        run_dir = self.cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        port_file = (run_dir / f"{name}.ports.json").resolve()
        port_file.unlink(missing_ok=True)
        # A local append-mode open; not worth a thread hop at start-up.
        out = open(run_dir / f"{name}.log", "ab") if self.cfg.log_to_files else None  # noqa: ASYNC230
        space, host = self.placement(name)
        # On emulated hosts `--host` binds gRPC and the data plane, and is what a process
        # advertises (the gateway binds the public address it is given).
        placed = topology.serve_args(host=host) if self.network is not None and name != "gateway" else []
        process = await asyncio.create_subprocess_exec(
            *(["ip", "netns", "exec", space] if space is not None else []),
            sys.executable,
            "-m",
            "services.mesh.child",
            str(os.getpid()),
            module,
            # Metrics on by default, on a free port written to the port file (`args` may fix it).
            *topology.serve_args(port_file=str(port_file), metrics_port="0"),
            *args,
            *placed,
            *self.cfg.security_args(),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT if out else None,
            env=child_env(),
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        proc = Proc(
            name,
            process,
            port_file,
            module,
            args,
            started_s=asyncio.get_running_loop().time(),
            host=host,
            netns=space,
        )
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.cfg.run_dir / f"{name}.log"

    async def respawn(self, old: Proc) -> Proc:
        """Start an exited child again with its arguments, on every port it had (peers hold them)."""
        fixed = [
            arg
            for key, flag in FIXED_PORT_FLAGS.items()
            if old.ports.get(key) is not None
            for arg in (flag, str(old.ports[key]))
        ]
        new = await self.spawn(old.name, old.module, [*old.args, *fixed])
        new.args = old.args
        new.ports = dict(old.ports)
        return new

    async def restart(self, name: str, sig: int = signal.SIGKILL) -> Proc:
        """Kill a service and start it again on the same ports (peers keep its address)."""
        async with self._replacing[name]:
            old = self.procs[name]
            with contextlib.suppress(ProcessLookupError):
                old.process.send_signal(sig)
            await old.process.wait()
            new = await self.respawn(old)
        await self.wait_ready(new, self.cfg.ready_timeout_s)
        return new

    def identity(self, role: str = roles.ADMIN, instance: str | None = None) -> Identity | None:
        """The certificate of `role` (of its `instance`) in this mesh (None for an --insecure mesh)."""
        return None if self.cfg.insecure else load_identity(self.cfg.tls_path, role, instance)

    def channel(self, name: str, as_role: str = roles.ADMIN) -> grpc.aio.Channel:
        """A channel to process `name` presenting `as_role`'s certificate (the gateway's public
        port takes none)."""
        if name == "gateway":
            return channel(self.gateway_grpc, identity=None)
        return self.connect(self.procs[name].grpc_address, role_of(name), as_role)

    def connect(self, address: str, peer: str, as_role: str = roles.ADMIN) -> grpc.aio.Channel:
        """A channel to the mesh service of role `peer` at `address`, as `as_role`."""
        return channel(address, peer, identity=self.identity(as_role))

    async def wait_ready(self, proc: Proc, timeout_s: float) -> None:
        """Port file written (server bound), then SERVING on health; fail fast if it exits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not proc.port_file.exists():
            if proc.process.returncode is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {describe_exit(proc.process.returncode)}; see {self.log_path(proc.name)}"
                )
            if loop.time() > deadline:
                raise TimeoutError(f"{proc.name} did not bind within {timeout_s}s")
            await asyncio.sleep(0.05)
        proc.ports = json.loads(proc.port_file.read_text())
        exited = asyncio.create_task(proc.process.wait())
        public = proc.name == "gateway"
        serving = asyncio.create_task(
            wait_for_serving(
                proc.grpc_address,
                max(deadline - loop.time(), 1.0),
                peer=role_of(proc.name),
                identity=None if public else self.identity(),
            )
        )
        done, _ = await asyncio.wait({exited, serving}, return_when=asyncio.FIRST_COMPLETED)
        if serving in done:
            exited.cancel()
            serving.result()
            return
        serving.cancel()
        raise RuntimeError(
            f"{proc.name} exited with {describe_exit(proc.process.returncode or 0)} before serving; "
            f"see {self.log_path(proc.name)}"
        )

    async def start(self) -> None:
        cfg = self.cfg
        await asyncio.to_thread(ensure_model, cfg.model_dir, cfg.model)
        if cfg.netns_rate_mbit is not None:
            self.network = await asyncio.to_thread(open_network, cfg)
        pm = await self.spawn(
            "param_manager",
            topology.PARAM_MANAGER.module,
            topology.param_manager_args(
                model_dir=str(cfg.model_dir), cache_slots=str(cfg.host_caches), topology_host="cache-host-0"
            ),
        )
        await self.wait_ready(pm, cfg.ready_timeout_s)
        caches = [
            await self.spawn(
                f"host_cache-{k}",
                topology.HOST_CACHE.module,
                topology.host_cache_args(
                    model_dir=str(cfg.model_dir),
                    index=pm.grpc_address,
                    cache_slot=str(k),
                    topology_host=f"cache-host-{k}",
                ),
            )
            for k in range(1, cfg.host_caches)
        ]
        await asyncio.gather(*(self.wait_ready(c, cfg.ready_timeout_s) for c in caches))
        gm = await self.spawn(
            "global_manager",
            topology.GLOBAL_MANAGER.module,
            [
                *topology.global_manager_args(
                    param_manager=pm.grpc_address,
                    model=cfg.model,
                    pool=cfg.manager_pool_args(),
                    autoscale=cfg.manager_autoscale_args(),
                ),
                *cfg.manager_args,
            ],
        )
        await self.wait_ready(gm, cfg.ready_timeout_s)
        workers = [
            await self.spawn(
                f"worker-{i}",
                topology.WORKER.module,
                [
                    # One accelerator per worker: each is its own topology host.
                    *topology.worker_args(
                        instance_id=f"worker-{i}",
                        topology_host=f"host-{i}",
                        global_manager=gm.grpc_address,
                        param_manager=pm.grpc_address,
                        role=cfg.worker_role(i),
                    ),
                    *cfg.worker_thread_args(),
                    *cfg.worker_args,
                ],
            )
            for i in range(cfg.worker_count)
        ]
        await asyncio.gather(*(self.wait_ready(w, cfg.ready_timeout_s) for w in workers))
        gw = await self.spawn(
            "gateway",
            topology.GATEWAY.module,
            [
                *topology.serve_args(host=cfg.host, port=str(cfg.grpc_port)),
                *topology.gateway_args(
                    http_host=cfg.host,
                    http_port=str(cfg.http_port),
                    global_manager=gm.grpc_address,
                    param_manager=pm.grpc_address,
                    schedule_wait_s=None if cfg.schedule_wait_s is None else str(cfg.schedule_wait_s),
                ),
                *cfg.gateway_args,
            ],
        )
        await self.wait_ready(gw, cfg.ready_timeout_s)
        if cfg.disaggregated:
            await self.wait_instances_serving(cfg.prefill + cfg.decode, cfg.ready_timeout_s, roles=cfg.serving_wanted())
        else:
            await self.wait_instances_serving(cfg.initial_instances, cfg.ready_timeout_s)
        if cfg.supervise:
            self.start_supervision()

    async def wait_instances_serving(
        self, n: int, timeout_s: float, *, roles: Mapping[str, int] | None = None
    ) -> dict[str, str]:
        """Until the manager reports n SERVING instances of the mesh's model (loaded through the
        pool) and, with `roles` (SDK role name -> count, e.g. {"prefill": 1, "decode": 2}), that
        many of each role: a split mesh with two decode instances and no prefill one is not up.
        Returns instance id -> role of the SERVING instances, and keeps it in `self.roles`."""
        from blitzmesh import convert
        from blitzmesh.v1 import admin_pb2, common_pb2, global_manager_pb2_grpc

        wanted = {role: k for role, k in (roles or {}).items() if role != "any"}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self.channel("global_manager") as ch:
            stub = global_manager_pb2_grpc.GlobalManagerStub(ch)
            while True:
                state = await stub.GetCluster(admin_pb2.GetClusterRequest(), timeout=5)
                serving = {
                    i.instance_id: convert.instance_role_from_proto(i.role)
                    for i in state.instances
                    if i.state == common_pb2.INSTANCE_STATE_SERVING and i.model_id == self.cfg.model
                }
                counts = collections.Counter(serving.values())
                if len(serving) >= n and all(counts[role] >= k for role, k in wanted.items()):
                    self.roles = serving
                    return serving
                if loop.time() > deadline:
                    have = ", ".join(f"{k} {role}" for role, k in sorted(counts.items())) or "none"
                    want = ", ".join(f"{k} {role}" for role, k in sorted(wanted.items())) or f"{n} in all"
                    raise TimeoutError(
                        f"instances of {self.cfg.model!r} SERVING after {timeout_s}s: {have}; wanted {want}"
                    )
                await asyncio.sleep(0.1)

    def start_supervision(self) -> asyncio.Task[str]:
        """Watch every child from now on (once): restart those that exit, until one cannot be kept."""
        if self.supervisor is None:
            self.supervisor = asyncio.create_task(self._supervise(), name="mesh-supervisor")
        return self.supervisor

    async def _supervise(self) -> str:
        """Returns why the mesh must stop (a child over its restart limit); runs until cancelled."""
        watchers = [asyncio.create_task(self._watch(name), name=f"watch-{name}") for name in self.procs]
        try:
            done, _ = await asyncio.wait(watchers, return_when=asyncio.FIRST_EXCEPTION)
            error = next((t.exception() for t in done if t.exception() is not None), None)
            if error is None:
                return "the mesh is stopping"  # every watcher returned: their children exited on a stop
            if isinstance(error, ChildFailed):
                return str(error)
            raise error
        finally:
            for t in watchers:
                t.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch(self, name: str) -> None:
        """Restart one child each time it exits, after the policy's backoff; raise ChildFailed
        when it exits once more than its restart limit allows."""
        loop = asyncio.get_running_loop()
        history = ChildHistory()
        while True:
            proc = self.procs[name]
            returncode = await proc.process.wait()
            if self.stopping:
                return
            async with self._replacing[name]:
                if self.procs[name] is not proc:
                    continue  # restart() replaced it meanwhile
                decision, history = decide(
                    self.cfg.restart_policy, history, now_s=loop.time(), started_s=proc.started_s
                )
                why = f"{name} exited ({describe_exit(returncode)})"
                if isinstance(decision, GiveUp):
                    raise ChildFailed(
                        f"{why} after {decision.restarts} restarts within {decision.window_s:g} s; "
                        f"not restarting it (log {self.log_path(name)})"
                    )
                print(
                    f"blitzmesh: {why}; restart {decision.attempt} in {decision.backoff_s:g} s "
                    f"(log {self.log_path(name)})",
                    file=sys.stderr,
                    flush=True,
                )
                await asyncio.sleep(decision.backoff_s)
                new = await self.respawn(proc)
            try:
                await self.wait_ready(new, self.cfg.ready_timeout_s)
            except (RuntimeError, TimeoutError):
                continue  # an exit is the next turn's to handle; a child that hangs stays as it is
            print(f"blitzmesh: {name} serves again on {new.grpc_address}", file=sys.stderr, flush=True)

    async def __aenter__(self) -> Mesh:
        """`async with Mesh(cfg) as mesh:` starts it (stopping what started if that fails) and stops it."""
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM everyone (gateway first so no new work arrives), then SIGKILL stragglers."""
        self.stopping = True
        if self.supervisor is not None and not self.supervisor.done():
            self.supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.supervisor
        order = [
            "gateway",
            *[n for n in self.procs if n.startswith("worker")],
            "global_manager",
            *[n for n in self.procs if n.startswith("host_cache")],
            "param_manager",
        ]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.process.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                await wait_for(proc.process.wait(), timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.process.kill()
                await proc.process.wait()
        if self.network is not None:
            await asyncio.to_thread(self.network.close)
            self.network = None

    async def run_forever(self) -> int:
        """`make up`: serve until Ctrl-C or SIGTERM (0), or a child exceeds its restart limit (1)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal() -> None:
            self.stopping = True
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        return await self.serve(stop)

    async def serve(self, stop: asyncio.Event) -> int:
        """Start, print the banner and supervise until `stop` is set (0), or until a child cannot
        be kept running (1, after printing which and why); 130 if stopped while starting. Every
        process is stopped on the way out."""
        stop_wait = asyncio.create_task(stop.wait())
        try:
            start = asyncio.create_task(self.start())
            done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if start not in done:
                start.cancel()
                return 130
            start.result()
            print_banner(self)
            supervisor = self.start_supervision()
            done, _ = await asyncio.wait({stop_wait, supervisor}, return_when=asyncio.FIRST_COMPLETED)
            if supervisor in done and not self.stopping:
                print(f"blitzmesh: {supervisor.result()}; stopping the mesh", file=sys.stderr, flush=True)
                return 1
            return 0
        finally:
            stop_wait.cancel()
            await self.stop()
            print("blitzmesh: all processes stopped", file=sys.stderr)


class ChildFailed(Exception):
    """A child exited more often than its restart policy allows."""


# Port-file keys and the flag that binds each again on restart (every service takes these).
FIXED_PORT_FLAGS = topology.PORT_FLAGS


def open_network(cfg: MeshConfig) -> netns.ShapedNetwork:
    """The emulated hosts of `cfg`: one per worker and per host cache, the root namespace joined,
    in a subnet of their own (10.78.x, x from this process id) so that meshes do not collide.
    Namespaces left by a run killed with SIGKILL are removed first."""
    reason = netns.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"netns_rate_mbit={cfg.netns_rate_mbit} needs network namespaces: {reason}")
    assert cfg.netns_rate_mbit is not None
    netns.remove_stale(prefix="bmesh-")
    plan = netns.plan(
        cfg.worker_count + cfg.host_caches,
        prefix=f"bmesh-{os.getpid()}",
        subnet=f"10.78.{os.getpid() % 250}",
        rate_mbit=cfg.netns_rate_mbit,
        join_root=True,
    )
    return netns.ShapedNetwork(plan).__enter__()


def role_of(name: str) -> str:
    """The workload role of the mesh's process `name` (its certificate)."""
    prefix = name.split("-", 1)[0]
    return {
        "gateway": roles.GATEWAY,
        "global_manager": roles.GLOBAL_MANAGER,
        "worker": roles.WORKER,
        "param_manager": roles.PARAM_MANAGER,
        "host_cache": roles.HOST_CACHE,
    }[prefix]


def instance_of(name: str) -> tuple[str, str] | None:
    """(role, instance id) of the mesh's process `name` when it presents a certificate of its
    own (services/common/roles.py's INSTANCE_ROLES): worker-<i> is instance worker-<i>,
    host_cache-<k> is host-cache-<k> (the id it registers with)."""
    role = role_of(name)
    if role == roles.WORKER:
        return role, name
    if role == roles.HOST_CACHE:
        return role, name.replace("_", "-")
    return None


def child_env() -> dict[str, str]:
    """The launcher's environment, unbuffered so logs reach run/*.log as they happen."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def ensure_model(model_dir: Path, model: str) -> Path:
    """The checkpoint directory of `model`: fetched and converted for the default model (once),
    synthesized for a preset name, else one that must already be in `model_dir`."""
    from services.model_format.default_model import ensure_default_model
    from services.model_format.synth import PRESETS, synthesize

    path = model_dir / model
    if model == DEFAULT_MODEL_ID:
        print(f"blitzmesh: fetching model {model!r} into {path} (once; tens of seconds)", file=sys.stderr)
        return ensure_default_model(model_dir)
    if (path / "config.json").exists():
        return path
    if model not in PRESETS:
        raise SystemExit(
            f"model {model!r} not found in {str(model_dir)!r}; expected the default {DEFAULT_MODEL_ID!r}, "
            f"a preset {sorted(PRESETS)} or a converted checkpoint (python -m services.model_format convert-gguf)"
        )
    print(f"blitzmesh: synthesizing model {model!r} into {path}", file=sys.stderr)
    return synthesize(path, model)


def describe_workers(cfg: MeshConfig, roles: Mapping[str, str]) -> str:
    """The banner's first line after "Blitzmesh is up:", e.g. "1 prefill + 2 decode workers
    (disaggregated: worker-0 prefill, worker-1 decode, worker-2 decode)"."""
    if not cfg.disaggregated:
        spare = cfg.worker_count - cfg.initial_instances
        return f"{cfg.worker_count} workers" + (f" ({cfg.initial_instances} loaded, {spare} idle)" if spare > 0 else "")
    spare = cfg.worker_count - cfg.prefill - cfg.decode
    text = f"{cfg.prefill} prefill + {cfg.decode} decode workers" + (f" + {spare} idle" if spare else "")
    serving = ", ".join(f"{iid} {role}" for iid, role in sorted(roles.items()))
    return f"{text} (disaggregated{': ' + serving if serving else ''})"


def describe_autoscaling(cfg: MeshConfig) -> str:
    """The banner's autoscaling line."""
    if not cfg.autoscale:
        return "off (--autoscale turns it on)"
    return f"heteroscale, up to {max(1, cfg.worker_count)} instances; new ones serve ZigZag requests while loading"


def describe_security(cfg: MeshConfig) -> str:
    """The banner's line on the internal hops' security."""
    if cfg.insecure:
        return "PLAINTEXT, no caller checks (--insecure; development only)"
    return f"mTLS, certificates in {cfg.tls_path}/ (admin.pem for operator tools; docs/security.md)"


def metrics_targets(mesh: Mesh) -> dict[str, str]:
    """Process name -> host:port of its Prometheus /metrics (every service serves one)."""
    return {
        name: f"{proc.host}:{proc.ports['metrics_port']}"
        for name, proc in mesh.procs.items()
        if proc.ports.get("metrics_port") is not None
    }


def describe_metrics(mesh: Mesh) -> str:
    """The banner's metrics line: each service's /metrics port."""
    targets = metrics_targets(mesh)
    return " ".join(f"{name}={target.rpartition(':')[2]}" for name, target in targets.items()) + (
        f" (/metrics; also in {mesh.cfg.run_dir}/<service>.ports.json)"
    )


def python_command() -> str:
    """This interpreter as a user would type it here (`.venv/bin/python` under `make up`)."""
    rel = os.path.relpath(sys.executable)
    return sys.executable if rel.startswith("..") else rel


def cli_command() -> str:
    """The `blitzmesh` console script beside this interpreter (pip installs it there)."""
    python = python_command()
    return str(Path(python).with_name("blitzmesh")) if os.sep in python else "blitzmesh"


def print_banner(mesh: Mesh) -> None:
    cfg = mesh.cfg
    burst = (
        f"""
Watch a trace burst scale it out (decisions, k/L of loading instances, ZigZag requests):
  {python_command()} -m services.mesh.burst --gateway {mesh.gateway_http} --admin {mesh.gateway_grpc} --model {cfg.model}
"""
        if cfg.autoscale
        else ""
    )
    print(
        f"""
Blitzmesh is up: {describe_workers(cfg, mesh.roles)}, model {cfg.model!r}
  OpenAI HTTP API  {mesh.gateway_http}/v1
  SDK gRPC API     {mesh.gateway_grpc}
  dashboard        {mesh.gateway_http}/dashboard
  global manager   {mesh.procs["global_manager"].grpc_address}
  param manager    {mesh.procs["param_manager"].grpc_address}
  autoscaling      {describe_autoscaling(cfg)}
  internal hops    {describe_security(cfg)}
  metrics          {describe_metrics(mesh)}
  logs             {cfg.run_dir}/

Try:
  curl -s {mesh.gateway_http}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{cfg.model}", "prompt": "Once upon a time", "max_tokens": 16}}'
  {cli_command()} status   (also: top, events --follow, scale, drain, policy; see docs/operations.md)
{burst}
Ctrl-C stops every process.""",
        flush=True,
    )
