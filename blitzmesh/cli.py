"""`blitzmesh`: the operator's command line, over the gateway's Admin API (the SDK's AsyncClient).

    blitzmesh status | top | events [--follow] | models
    blitzmesh scale MODEL N | drain INSTANCE | policy get | policy set NAME [KEY=VALUE ...]
    blitzmesh replay TRACE [burst options] | convert-gguf FILE OUT_DIR [options]
    blitzmesh certs rotate [--tls-dir DIR] [--ca-key PATH] [--days N]

Tables for people, `--json` for scripts. A failure (gateway unreachable, admin key missing or
refused, unknown instance or model) is one line on stderr saying what failed and how to fix it,
and exit code 2. The gateway defaults to the one `make up` started (its `run/gateway.ports.json`
in the current directory), else 127.0.0.1:50051; the admin key to BLITZMESH_ADMIN_API_KEY.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TextIO

from blitzmesh.client import ADMIN_API_KEY_ENV, DEFAULT_TARGET, AsyncClient
from blitzmesh.errors import AuthenticationError, BlitzmeshError, NotFoundError, UnavailableError
from blitzmesh.types import ClusterEvent, ClusterState, InstanceInfo

EXIT_FAILED = 2
PORT_FILE = Path("run") / "gateway.ports.json"
TLS_DIR = Path("run") / "tls"  # where make up keeps the mesh's CA and certificates
# The instance states that hold (or are getting) a model: what `scale MODEL N` counts.
LIVE_STATES = ("loading", "serving")


class CliError(Exception):
    """A failure the operator can fix: printed as one line, exit code 2."""


# ---- the gateway and its client ------------------------------------------------------------


def default_gateway(port_file: Path = PORT_FILE) -> str:
    """The gRPC address of the gateway `make up` started here, else the SDK's default."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return f"127.0.0.1:{int(json.loads(port_file.read_text())['grpc_port'])}"
    return DEFAULT_TARGET


def default_http(gateway: str, port_file: Path = PORT_FILE) -> str:
    """The gateway's HTTP base URL: its port file's http_port on the gateway's host, else :8000."""
    host = gateway.rpartition(":")[0] or "127.0.0.1"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return f"http://{host}:{int(json.loads(port_file.read_text())['http_port'])}"
    return f"http://{host}:8000"


def check_gateway(gateway: str) -> None:
    """HOST:PORT, the SDK gRPC address; a URL (the HTTP API's) is the usual mix-up."""
    host, sep, port = gateway.rpartition(":")
    if "://" in gateway or not sep or not host or not port.isdigit():
        raise CliError(
            f"--gateway {gateway!r} is not HOST:PORT; give the gateway's SDK gRPC address (make up prints it as "
            "'SDK gRPC API', e.g. 127.0.0.1:50051), not the HTTP URL"
        )


def explain(error: BlitzmeshError, gateway: str) -> str:
    """One line: what failed, and how to fix it."""
    details = error.details.strip().splitlines()[0] if error.details.strip() else error.code
    if isinstance(error, UnavailableError):
        return (
            f"cannot reach the gateway at {gateway!r} ({details}); start the mesh (make up) or pass "
            f"--gateway HOST:PORT (the SDK gRPC API address make up prints)"
        )
    if isinstance(error, AuthenticationError):
        return (
            f"the gateway at {gateway!r} refused the admin call ({error.code}: {details}); pass --admin-api-key KEY "
            f"or set {ADMIN_API_KEY_ENV} to one of the gateway's admin_api_keys"
        )
    return f"{error.code}: {details}"


def client(args: argparse.Namespace, timeout_s: float | None = 10.0) -> AsyncClient:
    return AsyncClient(args.gateway, admin_api_key=args.admin_api_key, timeout_s=timeout_s, max_retries=1)


# ---- tables ------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds > 0 else "-"


def layers(inst: InstanceInfo, model_layers: int = 0) -> str:
    """k/L, with a bar while loading. L is the larger of the instance's and `model_layers` (what
    the manager knows of a loading instance may lag the model's, which its peers know)."""
    num_layers = max(inst.num_layers, model_layers)
    if not num_layers:
        return "-"
    if inst.state == "loading":
        filled = round(10 * inst.layers_loaded / num_layers)
        return f"{inst.layers_loaded}/{num_layers} [{'#' * filled}{'.' * (10 - filled)}]"
    return f"{inst.layers_loaded}/{num_layers}"


INSTANCE_HEADERS = ("INSTANCE", "STATE", "ROLE", "MODEL", "LAYERS k/L", "RUN", "WAIT", "TTFT p50", "TBT p50", "HOST")


def instance_rows(state: ClusterState) -> list[list[object]]:
    model_layers: dict[str, int] = {}
    for i in state.instances:
        model_layers[i.model_id] = max(model_layers.get(i.model_id, 0), i.num_layers)
    return [
        [
            i.instance_id,
            i.state,
            i.role,
            i.model_id or "-",
            layers(i, model_layers[i.model_id] if i.model_id else 0),
            i.load.running,
            i.load.waiting,
            ms(i.load.ttft_p50_s),
            ms(i.load.tbt_p50_s),
            i.host or "-",
        ]
        for i in state.instances
    ]


def status_text(state: ClusterState) -> str:
    mode = " (advisory)" if state.advisory else ""
    counts: dict[str, int] = {}
    for i in state.instances:
        counts[i.state] = counts.get(i.state, 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no instances"
    text = f"policy {state.policy or '-'}{mode}; {summary}\n" + table(INSTANCE_HEADERS, instance_rows(state))
    if state.esp_groups:
        rows = [
            [
                g.group_id,
                g.degree,
                " ".join(f"{m}[{a}:{b})" for m, a, b in zip(g.member_ids, g.bounds, g.bounds[1:], strict=False)),
                " ".join(g.spare_ids) or "-",
                ("live:" + (",".join(h if n is None else f"{h}={n}" for h, n in g.kv_placement.items()) or "-"))
                if g.live
                else "ended",
                f"{g.age_s:.1f}",
            ]
            for g in state.esp_groups
        ]
        headers = ["GROUP", "DEGREE", "MEMBERS[SLICE]", "SPARES", "HOLDERS", "AGE_S"]
        text += "\nESP groups (newest first)\n" + table(headers, rows)
    return text


def event_line(ev: ClusterEvent) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(ev.time_s)) if ev.time_s > 1e9 else f"{ev.time_s:9.2f}"
    parts = [clock, ev.action, ev.target or "-", ev.status or "-"]
    if ev.instance_id:
        parts.append(f"[{ev.instance_id}]")
    return "  ".join(parts) + (f"  -- {ev.reason}" if ev.reason else "")


def as_json(value: Any) -> str:
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, bytes):
            return v.hex()
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict) or hasattr(v, "items"):
            return {k: plain(x) for k, x in v.items()}
        return v

    return json.dumps(plain(value), sort_keys=True)


# ---- commands ----------------------------------------------------------------------------


async def cmd_status(args: argparse.Namespace, out: TextIO) -> None:
    async with client(args) as c:
        state = await c.cluster()
    print(as_json(state) if args.json else status_text(state), file=out)


async def cmd_top(args: argparse.Namespace, out: TextIO) -> None:
    """Redraw the status every --interval-s seconds (clearing the screen on a terminal)."""
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    shown = 0
    async with client(args) as c:
        while args.count is None or shown < args.count:
            state = await c.cluster()
            stamp = time.strftime("%H:%M:%S")
            if args.json:
                print(as_json(state), file=out, flush=True)
            else:
                header = f"blitzmesh top  {args.gateway}  {stamp}  (every {args.interval_s:g}s, Ctrl-C quits)"
                print(f"{clear}{header}\n{status_text(state)}", file=out, flush=True)
            shown += 1
            if args.count is None or shown < args.count:
                await asyncio.sleep(args.interval_s)


async def cmd_events(args: argparse.Namespace, out: TextIO) -> None:
    """The manager's events as they happen: until Ctrl-C with --follow, else for --for-s seconds
    (or until --count events came)."""
    seen = 0
    async with client(args, timeout_s=None) as c:
        watch = c.watch_events()
        try:
            async with asyncio.timeout(None if args.follow else args.for_s):
                async for ev in watch:
                    print(as_json(ev) if args.json else event_line(ev), file=out, flush=True)
                    seen += 1
                    if args.count is not None and seen >= args.count:
                        return
        except TimeoutError:
            return
        finally:
            await watch.aclose()


async def cmd_models(args: argparse.Namespace, out: TextIO) -> None:
    async with client(args) as c:
        models = await c.list_models()
        state = await c.cluster()
    live = {
        m.model_id: sum(1 for i in state.instances if i.model_id == m.model_id and i.state in LIVE_STATES)
        for m in models
    }
    if args.json:
        print(as_json([{**json.loads(as_json(m)), "instances": live[m.model_id]} for m in models]), file=out)
        return
    rows = [
        [m.model_id, m.num_layers, f"{m.size_bytes / 2**20:.1f}", m.max_context, m.dtype or "-", live[m.model_id]]
        for m in models
    ]
    print(table(("MODEL", "LAYERS", "SIZE MiB", "CONTEXT", "DTYPE", "INSTANCES"), rows), file=out)


async def cmd_scale(args: argparse.Namespace, out: TextIO) -> None:
    """N instances of MODEL (LOADING + SERVING); with --delta, N more (or fewer)."""
    async with client(args, timeout_s=args.timeout_s) as c:
        state = await c.cluster()
        known = sorted({m.model_id for m in await c.list_models()})
        if args.model not in known:
            raise CliError(f"unknown model {args.model!r}; the mesh lists {known} (see: blitzmesh models)")
        now = sum(1 for i in state.instances if i.model_id == args.model and i.state in LIVE_STATES)
        delta = args.n if args.delta else args.n - now
        if not args.delta and args.n < 0:
            raise CliError(f"N must be >= 0 instances, got {args.n}")
        if delta == 0:
            result = {
                "model": args.model,
                "instances_before": now,
                "delta": 0,
                "instance_ids": [],
                "reason": "no change",
            }
        else:
            reply = await c.scale(args.model, delta, wait=args.wait)
            result = {
                "model": args.model,
                "instances_before": now,
                "delta": delta,
                "instance_ids": list(reply.instance_ids),
                "reason": reply.reason,
            }
    if args.json:
        print(json.dumps(result, sort_keys=True), file=out)
    else:
        verb = "adding" if delta > 0 else "draining" if delta < 0 else "keeping"
        ids = ", ".join(result["instance_ids"]) or "-"
        print(f"{args.model}: {now} live instance(s), {verb} {abs(delta) or now}: {ids} ({result['reason']})", file=out)


async def cmd_drain(args: argparse.Namespace, out: TextIO) -> None:
    async with client(args, timeout_s=args.timeout_s) as c:
        state = await c.cluster()
        inst = next((i for i in state.instances if i.instance_id == args.instance), None)
        if inst is None:
            known = [i.instance_id for i in state.instances]
            raise CliError(f"unknown instance {args.instance!r}; the cluster has {known} (see: blitzmesh status)")
        if inst.state != "serving":
            raise CliError(f"instance {args.instance!r} is {inst.state}, not serving; only a serving instance drains")
        reply = await c.scale(inst.model_id, -1, instance_ids=[inst.instance_id], wait=args.wait)
    result = {"instance_id": inst.instance_id, "model": inst.model_id, "drained": list(reply.instance_ids)}
    result["reason"] = reply.reason
    if args.json:
        print(json.dumps(result, sort_keys=True), file=out)
    else:
        print(f"{inst.instance_id} ({inst.model_id}): draining ({reply.reason})", file=out)


def parse_params(pairs: Sequence[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"policy parameter {pair!r} is not KEY=VALUE (e.g. target_requests_per_instance=4)")
        params[key] = value
    return params


async def cmd_policy(args: argparse.Namespace, out: TextIO) -> None:
    async with client(args) as c:
        if args.policy_command == "set":
            advisory = {"on": True, "off": False, None: None}[args.advisory]
            got = await c.set_policy(args.name, parse_params(args.params), advisory=advisory)
            policy, params, adv = got.policy, dict(got.params), got.advisory
        else:
            state = await c.cluster()
            policy, params, adv = state.policy, dict(state.policy_params), state.advisory
    if args.json:
        print(json.dumps({"policy": policy, "params": params, "advisory": adv}, sort_keys=True), file=out)
    else:
        print(f"policy {policy}{' (advisory: decides, does not act)' if adv else ''}", file=out)
        if params:
            print(table(("PARAMETER", "VALUE"), sorted(params.items())), file=out)


def cmd_replay(args: argparse.Namespace, out: TextIO) -> int:
    from services.mesh import burst  # the services' extras: imported only for this command

    if not args.trace.is_file():
        raise CliError(f"trace {str(args.trace)!r} is not a file (the repository ships traces/*.csv)")
    if args.admin_api_key:
        os.environ[ADMIN_API_KEY_ENV] = args.admin_api_key
    argv = ["--trace", str(args.trace), "--admin", args.gateway, "--gateway", args.http or default_http(args.gateway)]
    return burst.main([*argv, *args.burst_args])


def cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    from services.model_format.__main__ import main as model_format_main

    return model_format_main(["convert-gguf", *args.convert_args])


def cmd_certs(args: argparse.Namespace, out: TextIO) -> int:
    from services.common import pki, security  # the services' extras: imported only for this command

    try:
        days = args.days or pki.LEAF_DAYS
        renewed = pki.renew(args.tls_dir, ca_key=args.ca_key, days=days)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(as_json([{"certificate": name, "serial": format(serial, "x")} for name, serial in renewed]), file=out)
    else:
        print(table(("CERTIFICATE", "NEW SERIAL"), [(name, format(serial, "x")) for name, serial in renewed]), file=out)
        print(
            f"renewed {len(renewed)} certificates in {args.tls_dir}/, valid {days} days; running services "
            f"present them within {security.RELOAD_CHECK_S:g} s, without a restart",
            file=out,
        )
    return 0


# ---- the parser --------------------------------------------------------------------------


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


def common_options(top: bool) -> argparse.ArgumentParser:
    """The options every command takes, before or after its name. On the subcommands they default
    to SUPPRESS, so that a value given before the command name is not reset."""
    common = argparse.ArgumentParser(add_help=False)

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    common.add_argument(
        "--gateway",
        default=default(None),
        metavar="HOST:PORT",
        help=f"the gateway's SDK gRPC address (default: from {PORT_FILE} as make up writes it, else {DEFAULT_TARGET})",
    )
    common.add_argument(
        "--admin-api-key",
        default=default(None),
        metavar="KEY",
        help=f"one of the gateway's admin_api_keys (default: ${ADMIN_API_KEY_ENV}; a gateway with none takes "
        "admin calls from this machine without a key)",
    )
    common.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON for scripts instead of a table"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = common_options(top=False)
    p = argparse.ArgumentParser(
        prog="blitzmesh", description=__doc__.split("\n\n")[0], parents=[common_options(top=True)]
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    add("status", "the cluster as a table: instances, state, role, k/L while loading, load, TTFT, TBT")
    top = add("top", "the status, redrawn live")
    top.add_argument("--interval-s", type=positive, default=1.0, help="seconds between redraws (default 1)")
    top.add_argument("--count", type=count, default=None, help="stop after this many redraws (default: Ctrl-C)")
    ev = add("events", "the manager's decision log with reasons, as it happens")
    ev.add_argument("--follow", "-f", action="store_true", help="keep watching until Ctrl-C")
    ev.add_argument("--for-s", type=positive, default=5.0, help="without --follow: watch this long (default 5)")
    ev.add_argument("--count", type=count, default=None, help="stop after this many events")
    add("models", "the models the mesh can serve, with their live instances")
    sc = add("scale", "run N instances of MODEL (or N more/fewer with --delta)")
    sc.add_argument("model", metavar="MODEL")
    sc.add_argument("n", metavar="N", type=int)
    sc.add_argument("--delta", action="store_true", help="N is a change (+2, -1), not a total")
    sc.add_argument("--wait", action="store_true", help="return once the new instances serve (or failed)")
    sc.add_argument("--timeout-s", type=positive, default=300.0, help="deadline of the call (default 300)")
    dr = add("drain", "drain one serving instance (its requests finish; it becomes idle)")
    dr.add_argument("instance", metavar="INSTANCE")
    dr.add_argument("--wait", action="store_true", help="return once it has drained")
    dr.add_argument("--timeout-s", type=positive, default=300.0, help="deadline of the call (default 300)")
    po = add("policy", "show or set the scaling policy")
    posub = po.add_subparsers(dest="policy_command", required=True, metavar="get|set")
    posub.add_parser("get", help="the policy, its parameters and mode", parents=[common])
    ps = posub.add_parser("set", help="switch policy and parameters", parents=[common])
    ps.add_argument("name", metavar="NAME", help="heteroscale, utilization, latency, ...")
    ps.add_argument("params", metavar="KEY=VALUE", nargs="*", help="policy parameters (they replace the current)")
    ps.add_argument("--advisory", choices=("on", "off"), default=None, help="decide without acting (on) or act (off)")
    rp = add(
        "replay",
        "replay a trace burst against the mesh and print its scale-out (services.mesh.burst; its other options, "
        "e.g. --model, --peak-rps, --span-s, pass through)",
    )
    rp.add_argument(
        "trace", metavar="TRACE", type=Path, help="Azure LLM trace CSV, e.g. traces/azure_llm_2023_code.csv"
    )
    rp.add_argument(
        "--http", default=None, metavar="URL", help="the gateway's HTTP base URL (default: from the port file)"
    )
    ce = add("certs", "the mesh's certificates")
    cesub = ce.add_subparsers(dest="certs_command", required=True, metavar="rotate")
    cr = cesub.add_parser(
        "rotate",
        help="renew every certificate of the mesh in place; running services pick them up without a restart",
        parents=[common],
    )
    cr.add_argument(
        "--tls-dir", type=Path, default=TLS_DIR, help=f"the mesh's certificates (default {TLS_DIR}, make up's)"
    )
    cr.add_argument("--ca-key", type=Path, default=None, help="the CA's private key (default TLS_DIR/ca.key)")
    cr.add_argument("--days", type=count, default=None, help="lifetime of the new certificates (default 30)")
    cv = add("convert-gguf", "convert a Llama GGUF file into a checkpoint the mesh serves")
    cv.add_argument("convert_args", nargs=argparse.REMAINDER, help="FILE OUT_DIR [--dtype ...] [--force]")
    return p


COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], Coroutine[Any, Any, None]]] = {
    "status": cmd_status,
    "top": cmd_top,
    "events": cmd_events,
    "models": cmd_models,
    "scale": cmd_scale,
    "drain": cmd_drain,
    "policy": cmd_policy,
}


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout) -> int:
    parser = build_parser()
    # replay passes the options it does not know on to the burst tool (its --help lists them).
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "replay":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.burst_args = extra
    args.gateway = args.gateway or default_gateway()
    try:
        check_gateway(args.gateway)
        if args.command == "replay":
            return cmd_replay(args, out)
        if args.command == "convert-gguf":
            return cmd_convert(args, out)
        if args.command == "certs":
            return cmd_certs(args, out)
        asyncio.run(COMMANDS[args.command](args, out))
        return 0
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"blitzmesh {args.command}: {e}", file=sys.stderr)
    except NotFoundError as e:
        print(f"blitzmesh {args.command}: {e.details}", file=sys.stderr)
    except BlitzmeshError as e:
        print(f"blitzmesh {args.command}: {explain(e, args.gateway)}", file=sys.stderr)
    except ValueError as e:  # the SDK's argument checks quote the value
        print(f"blitzmesh {args.command}: {e}", file=sys.stderr)
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
