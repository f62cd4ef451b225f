"""The operator's view against a real mesh (issue 27): the `blitzmesh` CLI run as a command (every
command's table and JSON, and the failures: unreachable gateway, missing or wrong admin key,
unknown instance), `top` in tmux, the /dashboard in headless Chromium during a scale-out, and
/metrics on every service (names in one scheme, every Grafana panel naming an exported metric,
Prometheus scraping every target where it is installed).

The mesh's gateway has an admin key, so the key paths are real: the CLI gets it from
BLITZMESH_ADMIN_API_KEY, the dashboard from `?key=`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

import blitzmesh
from blitzmesh.v1 import admin_pb2, admin_pb2_grpc
from services.common.grpc_util import channel
from services.common.waiting import wait_until
from services.mesh.launcher import Mesh, MeshConfig, metrics_targets
from tests.e2e.conftest import running_mesh
from tests.harness.admin import unchanged_policy
from tests.unit.test_gguf import write_tiny_gguf

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
ADMIN_KEY = "adm-ops-test-key-0001"
GRAFANA = ROOT / "deploy" / "grafana" / "blitzmesh.json"
# The service part of every metric name (blitzmesh_<service>_<thing>_<unit>), by process.
SERVICE_PREFIX = {
    "gateway": "blitzmesh_gateway_",
    "global_manager": "blitzmesh_gm_",
    "param_manager": "blitzmesh_param_",
    "host_cache": "blitzmesh_param_",
    "worker": "blitzmesh_worker_",
}
# Components every service runs export under their own name (one scrape target says which
# process): the caller check on gRPC and the data plane's peer check.
SHARED_PREFIXES = ("blitzmesh_auth_", "blitzmesh_dataplane_")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ops_mesh(
    make_mesh_config: Callable[..., MeshConfig], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    """3 workers (1 loaded, 2 idle for a scale-out), a host cache besides the parameter manager,
    and an admin key on the gateway."""
    cfg = make_mesh_config(tmp_path_factory.mktemp("run-ops"), workers=3, host_caches=2)
    cfg.initial_instances = 1
    cfg.gateway_args = [*cfg.gateway_args, "--admin-api-keys", json.dumps([ADMIN_KEY])]
    # Slow worker links (10 Mbit/s: the tiny model's 3.5 MB in about 3 s), so that a scale-out
    # is seen loading.
    cfg.worker_args = [*cfg.worker_args, "--dataplane-link-gbps", "0.01"]
    async with running_mesh(cfg) as m:
        yield m


def cli_env(key: str | None = ADMIN_KEY) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "BLITZMESH_ADMIN_API_KEY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if key is not None:
        env["BLITZMESH_ADMIN_API_KEY"] = key
    return env


async def cli(*args: str, key: str | None = ADMIN_KEY, timeout_s: float = 120.0) -> tuple[int, str, str]:
    """Run `blitzmesh ARGS` as a process (the console script's module); (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "blitzmesh.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(key),
        cwd=ROOT,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


def assert_one_line_failure(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, f"exit code {rc}, stderr {err!r}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got {lines}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


# ---- the CLI -----------------------------------------------------------------------------


async def test_console_script_declared() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, func = scripts["blitzmesh"].partition(":")
    assert (module, func) == ("blitzmesh.cli", "main")
    import blitzmesh.cli

    assert callable(blitzmesh.cli.main)


async def test_status_table_and_json(ops_mesh: Mesh) -> None:
    rc, out, err = await cli("status", "--gateway", ops_mesh.gateway_grpc)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("policy ") and "1 serving" in lines[0] and "2 idle" in lines[0]
    assert lines[1].split()[:4] == ["INSTANCE", "STATE", "ROLE", "MODEL"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"worker-0", "worker-1", "worker-2"}
    serving = [r for r in rows.values() if r[1] == "serving"]
    assert len(serving) == 1 and serving[0][3] == MODEL and serving[0][4] == "2/2"

    rc, out, err = await cli("--json", "status", "--gateway", ops_mesh.gateway_grpc)
    assert rc == 0, err
    state = json.loads(out)
    assert sorted(i["instance_id"] for i in state["instances"]) == ["worker-0", "worker-1", "worker-2"]
    assert {i["state"] for i in state["instances"]} == {"serving", "idle"}
    assert all("load" in i and "ttft_p50_s" in i["load"] for i in state["instances"])


async def test_models_table_and_json(ops_mesh: Mesh) -> None:
    rc, out, err = await cli("models", "--gateway", ops_mesh.gateway_grpc)
    assert rc == 0, err
    header, row = out.splitlines()
    assert header.split() == ["MODEL", "LAYERS", "SIZE", "MiB", "CONTEXT", "DTYPE", "INSTANCES"]
    assert row.split()[0] == MODEL and row.split()[1] == "2"
    rc, out, err = await cli("models", "--json", "--gateway", ops_mesh.gateway_grpc)
    assert rc == 0, err
    (model,) = json.loads(out)
    assert model["model_id"] == MODEL and model["num_layers"] == 2 and model["instances"] >= 1


async def test_policy_get_and_set(ops_mesh: Mesh) -> None:
    gw = ("--gateway", ops_mesh.gateway_grpc)
    rc, out, err = await cli("policy", "set", "heteroscale", "target_requests_per_instance=6", "--advisory", "on", *gw)
    assert rc == 0, err
    assert out.splitlines()[0] == "policy heteroscale (advisory: decides, does not act)"
    assert "target_requests_per_instance  6" in out
    rc, out, err = await cli("policy", "get", "--json", *gw)
    assert rc == 0, err
    assert json.loads(out) == {
        "policy": "heteroscale",
        "params": {"target_requests_per_instance": "6"},
        "advisory": True,
    }
    rc, out, err = await cli("policy", "get", *gw)
    assert rc == 0 and out.startswith("policy heteroscale (advisory")
    rc, _, err = await cli("policy", "set", "heteroscale", "oops", *gw)
    assert_one_line_failure(rc, err, "'oops'", "KEY=VALUE")
    rc, _, err = await cli("policy", "set", "nonesuch", *gw)
    assert_one_line_failure(rc, err, "nonesuch")


async def test_events_show_decisions_with_reasons(ops_mesh: Mesh) -> None:
    """`events --json --count 1` prints the next event: a policy change, sent until the watch
    (two hops) is live."""
    gw = ops_mesh.gateway_grpc
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "blitzmesh.cli", "events", "--follow", "--count", "1", "--json", "--gateway", gw),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    async with channel(gw) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
        for _ in range(60):  # one SetPolicy each half second, 30 s at most
            await admin.SetPolicy(await unchanged_policy(admin, metadata), timeout=10, metadata=metadata)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 0.5)
                break
        else:
            proc.kill()
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    event = json.loads(out.decode().splitlines()[0])
    assert event["action"] == "policy" and event["status"] == "set" and "params=" in event["reason"]

    rc, out, err = await cli("events", "--for-s", "0.5", "--gateway", gw)
    assert rc == 0 and "Traceback" not in err


async def test_failures_are_one_line_with_exit_code_2(ops_mesh: Mesh) -> None:
    gw = ops_mesh.gateway_grpc
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    rc, _, err = await cli("status", "--gateway", dead)
    assert_one_line_failure(rc, err, "cannot reach the gateway", dead, "--gateway")
    rc, _, err = await cli("status", "--gateway", gw, key=None)
    assert_one_line_failure(rc, err, "refused the admin call", "--admin-api-key", "BLITZMESH_ADMIN_API_KEY")
    rc, _, err = await cli("status", "--gateway", gw, "--admin-api-key", "adm-wrong-key-999")
    assert_one_line_failure(rc, err, "UNAUTHENTICATED", "--admin-api-key")
    rc, _, err = await cli("drain", "worker-99", "--gateway", gw)
    assert_one_line_failure(rc, err, "unknown instance 'worker-99'", "worker-0")
    rc, _, err = await cli("scale", "no-such-model", "2", "--gateway", gw)
    assert_one_line_failure(rc, err, "unknown model 'no-such-model'", MODEL)
    rc, _, err = await cli("top", "--interval-s", "0", "--gateway", gw)
    assert rc == 2 and "'0'" in err  # argparse's own usage error, quoting the value


async def test_top_bounded_json(ops_mesh: Mesh) -> None:
    rc, out, err = await cli("top", "--count", "2", "--interval-s", "0.2", "--json", "--gateway", ops_mesh.gateway_grpc)
    assert rc == 0, err
    snapshots = [json.loads(line) for line in out.splitlines()]
    assert len(snapshots) == 2 and all(len(s["instances"]) == 3 for s in snapshots)


def tmux(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=check)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
async def test_top_redraws_in_tmux(ops_mesh: Mesh, tmp_path: Path) -> None:
    session = f"bm-top-{os.getpid()}"
    env_args = [f"{k}={v}" for k, v in cli_env().items() if k in ("PYTHONPATH", "BLITZMESH_ADMIN_API_KEY")]
    command = f"env {' '.join(env_args)} {sys.executable} -m blitzmesh.cli top --interval-s 0.3 --gateway {ops_mesh.gateway_grpc}"
    await asyncio.to_thread(tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "30", command)

    def screen() -> str:
        return tmux("capture-pane", "-p", "-t", session).stdout

    def table_on_screen() -> str | None:
        text = screen()
        return text if "worker-2" in text and "INSTANCE" in text else None

    try:
        first = await wait_until(table_on_screen, 60, interval_s=0.1, what="top's table")
        stamp = re.search(r"\d\d:\d\d:\d\d", first)
        assert stamp is not None and first.count("blitzmesh top") == 1  # the screen is cleared each time
        await wait_until(
            lambda: (m := re.search(r"\d\d:\d\d:\d\d", screen())) is not None and m.group() != stamp.group(),
            10,
            interval_s=0.1,
            what="a redraw with a new time",
        )
        await asyncio.to_thread(tmux, "send-keys", "-t", session, "C-c")
        await wait_until(
            lambda: tmux("has-session", "-t", session, check=False).returncode != 0,
            10,
            interval_s=0.1,
            what="top to quit on Ctrl-C",
        )
    finally:
        await asyncio.to_thread(tmux, "kill-session", "-t", session, check=False)


async def test_replay_and_convert_commands(ops_mesh: Mesh, tmp_path: Path) -> None:
    http = ops_mesh.gateway_http
    trace = ROOT / "traces" / "azure_llm_2023_code.csv"
    burst = ["--model", MODEL, "--span-s", "2", "--lead-s", "0", "--peak-rps", "2", "--tail-s", "0.5"]
    burst += ["--max-requests", "4", "--max-output-tokens", "4", "--cluster-every-s", "0.5"]
    rc, out, err = await cli("replay", str(trace), "--gateway", ops_mesh.gateway_grpc, "--http", http, *burst)
    assert rc == 0, out[-2000:] + err[-2000:]
    assert "Traceback" not in err
    rc, _, err = await cli("replay", str(tmp_path / "missing.csv"), "--gateway", ops_mesh.gateway_grpc)
    assert_one_line_failure(rc, err, "missing.csv", "is not a file")
    # convert-gguf is the converter's own command line.
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    rc, out, err = await cli("convert-gguf", str(source), str(tmp_path / "out"))
    assert rc == 0, err
    assert out.startswith(str(tmp_path / "out")) and (tmp_path / "out" / "config.json").is_file()
    rc, out, err = await cli("convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out2"))
    assert rc == 2 and "missing.gguf" in err and "Traceback" not in err


# ---- the dashboard -----------------------------------------------------------------------


def read_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def chrome_reason() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    for binary in ("chromium", "chromedriver"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (apt-get install chromium chromium-driver)"
    return None


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture
def browser() -> Any:
    reason = chrome_reason()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or ""
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def send_burst(http: str, n: int, stop: list[bool]) -> list[int]:
    """Completions one after another until `stop` holds something, n at most; their statuses."""
    statuses = []
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32}).encode()
    for _ in range(n):
        if stop:
            break
        req = urllib.request.Request(f"{http}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                statuses.append(r.status)
        except urllib.error.HTTPError as e:
            statuses.append(e.code)
    return statuses


async def test_dashboard_shows_a_scale_out_within_2s(ops_mesh: Mesh, browser: Any, tmp_path: Path) -> None:
    http, gw = ops_mesh.gateway_http, ops_mesh.gateway_grpc
    assert http_status(f"{http}/dashboard") == 401  # the gateway has admin keys: loopback needs one too
    assert http_status(f"{http}/dashboard?key=adm-wrong-key-999") == 401
    assert http_status(f"{http}/dashboard/stream") == 401
    assert http_status(f"{http}/dashboard?key={ADMIN_KEY}") == 200

    def find(css: str) -> dict[str, Any] | None:
        """The first match's text and attributes, and the number of matches, read in one go
        (the page redraws its cards twice a second: a held element would go stale)."""
        return browser.execute_script(
            "const all = document.querySelectorAll(arguments[0]); if (!all.length) return null;"
            "const attrs = {}; for (const a of all[0].attributes) attrs[a.name] = a.value;"
            "return {count: all.length, text: all[0].innerText, attrs: attrs};",
            css,
        )

    await asyncio.to_thread(browser.get, f"{http}/dashboard?key={ADMIN_KEY}")
    await wait_until(lambda: (c := find(".card")) and c["count"] == 3, 30, interval_s=0.1, what="three instance cards")
    assert find("#connection") == {"count": 1, "text": "live", "attrs": {"id": "connection", "class": "pill live"}}

    # The page's event stream is live once a policy change reaches its timeline.
    async with channel(gw) as ch:
        admin = admin_pb2_grpc.AdminStub(ch)
        metadata = (("authorization", f"Bearer {ADMIN_KEY}"),)
        for _ in range(30):
            await admin.SetPolicy(await unchanged_policy(admin, metadata), timeout=10, metadata=metadata)
            with contextlib.suppress(TimeoutError):
                await wait_until(lambda: find('li[data-action="policy"]'), 1.0, interval_s=0.05, what="policy event")
                break
        else:
            raise AssertionError("the dashboard's timeline never showed an event")

        # A watch of our own stamps when each event reaches a client of the gateway.
        seen: dict[tuple[str, str], float] = {}

        async def watch() -> None:
            call = admin.WatchEvents(admin_pb2.WatchEventsRequest(), metadata=metadata)
            async for ev in call:
                seen.setdefault((ev.action, ev.instance_id), time.time())

        watcher = asyncio.create_task(watch())
        for _ in range(30):  # live once it has seen a policy event too
            await admin.SetPolicy(await unchanged_policy(admin, metadata), timeout=10, metadata=metadata)
            with contextlib.suppress(TimeoutError):
                await wait_until(lambda: ("policy", "") in seen, 1.0, interval_s=0.02, what="our watch live")
                break
        stop: list[bool] = []
        burst = [asyncio.create_task(asyncio.to_thread(send_burst, http, 300, stop)) for _ in range(3)]
        try:
            rc, out, err = await cli("scale", MODEL, "2", "--json", "--gateway", gw)
            assert rc == 0, err
            result = json.loads(out)
            assert result["delta"] == 1 and len(result["instance_ids"]) == 1
            (new,) = result["instance_ids"]
            await wait_until(
                lambda: ("scale_out", new) in seen, 10, interval_s=0.02, what="the scale_out event on our watch"
            )
            event_s = seen[("scale_out", new)]
            li = await wait_until(
                lambda: find(f'li[data-action="scale_out"][data-instance-id="{new}"]'),
                5,
                interval_s=0.05,
                what="timeline",
            )
            card = await wait_until(
                lambda: (c := find(f'.card[data-instance-id="{new}"]')) and c["attrs"].get("data-active-since-ms"),
                5,
                interval_s=0.05,
                what="the new instance's card loading or serving",
            )
            shown_s = int(li["attrs"]["data-shown-ms"]) / 1000
            active_s = int(card) / 1000
            print(f"dashboard: scale_out shown {shown_s - event_s:+.3f}s, card active {active_s - event_s:+.3f}s")
            assert shown_s - event_s <= 2.0, "the scale-out reached the timeline within 2 s"
            assert active_s - event_s <= 2.0, "the new instance's card shows it loading/serving within 2 s"
            assert "Admin.Scale" in li["text"]  # its reason
            # While it loads (its links are slowed): the card's k/L bar, partly filled, and the
            # transfer chain into it. The screenshot is of that moment.
            loading = await wait_until(
                lambda: (c := find(f'.card[data-instance-id="{new}"]')) and c["attrs"]["data-state"] == "loading" and c,
                10,
                interval_s=0.05,
                what="the new instance's card loading",
            )
            k, num_layers = map(int, re.search(r"layers (\d+)/(\d+)", loading["text"]).groups())  # type: ignore[union-attr]
            assert k < num_layers, loading["text"]
            bar = find(f'.card[data-instance-id="{new}"] .bar .fill')
            assert bar is not None and bar["attrs"]["style"] == f"width: {100 * k / num_layers:.0f}%;", bar
            chain = await wait_until(lambda: find("#chains li.chain"), 10, interval_s=0.05, what="a transfer chain")
            assert new in chain["text"] and "→" in chain["text"]
            # The picture: best with some of its layers there (k > 0), if a snapshot catches it.
            with contextlib.suppress(TimeoutError):
                await wait_until(
                    lambda: (
                        (c := find(f'.card[data-instance-id="{new}"]'))
                        and c["attrs"]["data-state"] == "loading"
                        and not re.search(r"layers 0/", c["text"])
                    ),
                    5,
                    interval_s=0.02,
                    what="k > 0",
                )
            # BLITZMESH_SAVE_SCREENSHOT=1 replaces the picture docs/ shows; else it stays with the test.
            save = os.environ.get("BLITZMESH_SAVE_SCREENSHOT") == "1"
            picture = ROOT / "docs" / "images" / "dashboard.png" if save else tmp_path / "dashboard.png"
            assert await asyncio.to_thread(browser.save_screenshot, str(picture))
            # Requests flow: the rate shows; the bar is full once it serves.
            await wait_until(
                lambda: find("#rate")["text"] not in ("-", "0.00"), 30, interval_s=0.1, what="a request rate"
            )
            await wait_until(
                lambda: (c := find(f'.card[data-instance-id="{new}"]')) and c["attrs"]["data-state"] == "serving",
                60,
                interval_s=0.1,
                what="the new instance serving",
            )
            assert find(f'.card[data-instance-id="{new}"] .layers')["text"] == "layers 2/2"
        finally:
            stop.append(True)
            statuses = [s for task in burst for s in await task]
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
    assert statuses and all(s == 200 for s in statuses)

    # A page opened after all that draws it: the manager's history holds the scale-out and the
    # samples of the burst, and the fresh page shows both (in its timeline and on its charts).
    assert http_status(f"{http}/dashboard/history") == 401
    # A sample a second: wait for one taken after the new instance turned SERVING.
    past = await wait_until(
        lambda: (
            (h := read_json(f"{http}/dashboard/history?key={ADMIN_KEY}"))["samples"][-1]["instances"]["serving"] >= 2
            and h
        ),
        5,
        interval_s=0.2,
        what="a history sample with two instances serving",
    )
    assert past["window_s"] == 900
    (out,) = [e for e in past["events"] if e["action"] == "scale_out" and e["instance_id"] == new]
    assert out["at_s"] <= past["now_s"] and "Admin.Scale" in out["reason"]
    assert any(x["request_rate"] > 0 for x in past["samples"]), "the burst's routed requests are in the samples"

    await asyncio.to_thread(browser.get, f"{http}/dashboard?key={ADMIN_KEY}")
    entry = await wait_until(
        lambda: find(f'li[data-action="scale_out"][data-instance-id="{new}"]'), 10, interval_s=0.1, what="the past"
    )
    assert entry["attrs"].get("data-from-history") == "1" and "Admin.Scale" in entry["text"]
    markers = await wait_until(
        lambda: find(f'#chart-instances .marker[data-action="scale_out"][data-instance-id="{new}"]'),
        10,
        interval_s=0.1,
        what="the scale-out's marker on the instances chart",
    )
    assert abs(float(markers["attrs"]["data-at-s"]) - out["at_s"]) < 1.0
    assert find('.marker[data-action="scale_out"]')["count"] >= 4  # on each of the four charts

    def drawn() -> dict[str, Any] | None:
        """Per chart: its canvas's size and, per series, the points that have a value."""
        return browser.execute_script(
            "const out = {};"
            "for (const [id, u] of Object.entries(window.dashboard.charts)) {"
            "  const c = document.querySelector('#' + id + ' canvas');"
            "  out[id] = {w: c.width, h: c.height, points: u.data.slice(1).map(s => s.filter(v => v !== null).length),"
            "             max: u.data.slice(1).map(s => Math.max(0, ...s.filter(v => v !== null)))};"
            "}"
            "return out;"
        )

    charts = await wait_until(
        lambda: (d := drawn()) and all(c["points"][0] >= 2 for c in d.values()) and d,
        10,
        interval_s=0.1,
        what="four charts with points",
    )
    assert set(charts) == {"chart-rate", "chart-ttft", "chart-tbt", "chart-instances"}
    assert all(c["w"] > 0 and c["h"] > 0 for c in charts.values()), charts
    assert charts["chart-rate"]["max"][0] > 0, "requests/s"
    assert charts["chart-ttft"]["max"][0] > 0 and charts["chart-tbt"]["max"][0] > 0, charts
    assert charts["chart-instances"]["max"][0] >= 2, "the scaled-out instance serving too"
    # Live samples keep coming after the past: the last point moves on.
    first = browser.execute_script("return window.dashboard.history.times.at(-1)")
    await wait_until(
        lambda: browser.execute_script("return window.dashboard.history.times.at(-1)") > first,
        10,
        interval_s=0.1,
        what="a live sample after the history",
    )


async def test_scale_and_drain_commands(ops_mesh: Mesh) -> None:
    gw = ("--gateway", ops_mesh.gateway_grpc)
    rc, out, err = await cli("scale", MODEL, "2", *gw, "--wait")
    assert rc == 0, err
    # 2 already when the dashboard test ran (it scaled out), else 1 more now.
    assert out.startswith((f"{MODEL}: 2 live instance(s), keeping", f"{MODEL}: 1 live instance(s), adding 1"))
    rc, out, err = await cli("--json", "status", *gw)
    serving = sorted(i["instance_id"] for i in json.loads(out)["instances"] if i["state"] == "serving")
    assert len(serving) == 2
    victim = serving[-1]
    rc, out, err = await cli("drain", victim, "--wait", "--json", *gw)
    assert rc == 0, err
    assert json.loads(out)["drained"] == [victim]
    rc, out, err = await cli("status", "--json", *gw)
    states = {i["instance_id"]: i["state"] for i in json.loads(out)["instances"]}
    assert states[victim] in ("draining", "idle") and list(states.values()).count("serving") == 1
    rc, _, err = await cli("drain", victim, *gw)
    assert_one_line_failure(rc, err, f"instance {victim!r} is", "not serving")
    # The manager's own checks behind Admin.Scale with named instances.
    async with blitzmesh.AsyncClient(ops_mesh.gateway_grpc, admin_api_key=ADMIN_KEY) as client:
        with pytest.raises(blitzmesh.NotFoundError, match="unknown instance 'worker-99'"):
            await client.scale(MODEL, -1, instance_ids=["worker-99"])
        with pytest.raises(blitzmesh.BlitzmeshError, match=f"instance {victim!r} is"):
            await client.scale(MODEL, -1, instance_ids=[victim])
        with pytest.raises(ValueError, match="delta must be -1"):
            await client.scale(MODEL, -2, instance_ids=[victim])


# ---- metrics -----------------------------------------------------------------------------


def scrape(target: str) -> set[str]:
    """Every name a /metrics answer exports: its samples', and for families without samples yet
    (labelled ones nothing has touched) the sample names their type implies."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
        text = r.read().decode()
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return names


def grafana_metric_names() -> dict[str, set[str]]:
    dashboard = json.loads(GRAFANA.read_text())
    return {
        panel["title"]: {m for t in panel["targets"] for m in re.findall(r"blitzmesh_[a-z0-9_]+", t["expr"])}
        for panel in dashboard["panels"]
    }


async def test_every_service_exports_metrics_and_every_panel_names_one(ops_mesh: Mesh) -> None:
    targets = metrics_targets(ops_mesh)
    assert set(targets) == {
        "param_manager",
        "host_cache-1",
        "global_manager",
        "worker-0",
        "worker-1",
        "worker-2",
        "gateway",
    }
    for name, proc in ops_mesh.procs.items():
        assert json.loads(proc.port_file.read_text())["metrics_port"] == int(targets[name].rpartition(":")[2])
    exported: set[str] = set()
    for name, target in targets.items():
        names = await asyncio.to_thread(scrape, target)
        ours = {n for n in names if n.startswith("blitzmesh_")}
        prefix = SERVICE_PREFIX[name.split("-")[0]]
        assert ours, f"{name} exports no blitzmesh_ metric"
        stray = sorted(n for n in ours if not n.startswith((prefix, *SHARED_PREFIXES)))
        assert not stray, f"{name}: {stray}"
        exported |= ours
    panels = grafana_metric_names()
    assert len(panels) >= 15 and all(panels.values()), "every panel queries a blitzmesh metric"
    missing = {title: sorted(names - exported) for title, names in panels.items() if names - exported}
    assert not missing, f"panels naming metrics no service exports: {missing}"


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus is not installed (apt-get install prometheus)"
)
async def test_prometheus_scrapes_every_target(ops_mesh: Mesh, tmp_path: Path) -> None:
    targets = metrics_targets(ops_mesh)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": name, "static_configs": [{"targets": [target]}]} for name, target in sorted(targets.items())
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile() as log:
        proc = await asyncio.to_thread(
            subprocess.Popen,
            [
                "prometheus",
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:

            def health() -> dict[str, str] | None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5) as r:
                        active = json.load(r)["data"]["activeTargets"]
                except (OSError, ValueError):
                    return None
                got = {t["labels"]["job"]: t["health"] for t in active}
                return got if len(got) == len(targets) and all(h == "up" for h in got.values()) else None

            up = await wait_until(health, 60, interval_s=0.5, what="every target up in Prometheus")
            assert set(up) == set(targets)
            query = (
                "http://127.0.0.1:{}/api/v1/query?query=count%20by%20(job)%20(%7B__name__%3D~%22blitzmesh_.%2B%22%7D)"
            )
            result = await asyncio.to_thread(read_json, query.format(port))
            jobs = {res["metric"]["job"] for res in result["data"]["result"]}
            assert jobs == set(targets), "Prometheus holds blitzmesh_ series from every service"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
