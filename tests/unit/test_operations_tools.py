"""The pure parts of the operator's tools: the CLI's tables and argument checks, the dashboard's
peer and rate figures, and the Grafana dashboard's shape (the e2e test checks its metric names
against a real mesh)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from blitzmesh import cli
from blitzmesh.types import ClusterState, InstanceInfo, LoadReport
from services.gateway.auth import is_loopback_peer
from services.gateway.dashboard import http_peer, window_stats

ROOT = Path(__file__).resolve().parents[2]


def test_layers_bar_while_loading_and_plain_after() -> None:
    assert cli.layers(InstanceInfo("w", state="loading", layers_loaded=3, num_layers=10)) == "3/10 [###.......]"
    assert cli.layers(InstanceInfo("w", state="serving", layers_loaded=10, num_layers=10)) == "10/10"
    assert cli.layers(InstanceInfo("w", state="idle")) == "-"
    # The manager's L of a loading instance may lag (1 until it learns it): the model's wins.
    assert cli.layers(InstanceInfo("w", state="loading", layers_loaded=0, num_layers=1), 2) == "0/2 [..........]"


def test_status_text_counts_states_and_aligns_columns() -> None:
    state = ClusterState(
        instances=(
            InstanceInfo(
                "worker-0",
                state="serving",
                role="colocated",
                model_id="m",
                num_layers=2,
                layers_loaded=2,
                load=LoadReport(running=3, waiting=1, ttft_p50_s=0.125, tbt_p50_s=0.02),
            ),
            InstanceInfo("worker-10", state="idle", role="colocated"),
        ),
        policy="heteroscale",
        advisory=True,
    )
    lines = cli.status_text(state).splitlines()
    assert lines[0] == "policy heteroscale (advisory); 1 idle, 1 serving"
    assert lines[2].split() == ["worker-0", "serving", "colocated", "m", "2/2", "3", "1", "125ms", "20ms", "-"]
    assert lines[1].index("STATE") == lines[2].index("serving") == lines[3].index("idle")


def test_status_text_lists_esp_groups_with_each_members_slice() -> None:
    from blitzmesh.types import EspGroup

    holders = ("w-1", "w-2", "w-3")
    live = EspGroup("esp-2-s", "s", "m", ("w-1", "w-2"), (0, 64, 120), ("w-3",), 0.5, holders, True, (64, 60, 12))
    unsaid = EspGroup("esp-3-t", "t", "m", ("w-1", "w-2"), (0, 64, 120), (), 0.2, holders, True)  # no KV figures
    ended = EspGroup("esp-1-r", "r", "m", ("w-1", "w-2"), (0, 64, 120), ("w-3",), 1.5)
    lines = cli.status_text(ClusterState(esp_groups=(live, unsaid, ended))).splitlines()
    assert lines[-4].split() == ["GROUP", "DEGREE", "MEMBERS[SLICE]", "SPARES", "HOLDERS", "AGE_S"]
    # Each holder with the KV tokens it holds: the members' slices (the master's with its
    # decoded tokens, 56 + 4) and the spare's share after a scale-up.
    assert lines[-3].split() == ["esp-2-s", "2", "w-1[0:64)", "w-2[64:120)", "w-3", "live:w-1=64,w-2=60,w-3=12", "0.5"]
    assert lines[-2].split()[-2] == "live:w-1,w-2,w-3"
    assert lines[-1].split() == ["esp-1-r", "2", "w-1[0:64)", "w-2[64:120)", "w-3", "ended", "1.5"]
    assert live.kv_placement == {"w-1": 64, "w-2": 60, "w-3": 12}
    assert unsaid.kv_placement == {"w-1": None, "w-2": None, "w-3": None}


def test_parse_params_quotes_what_is_wrong() -> None:
    assert cli.parse_params(["a=1", "b=x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(cli.CliError, match="'oops' is not KEY=VALUE"):
        cli.parse_params(["oops"])


def test_default_gateway_reads_the_port_file(tmp_path: Path) -> None:
    port_file = tmp_path / "gateway.ports.json"
    assert cli.default_gateway(port_file) == "127.0.0.1:50051"
    port_file.write_text(json.dumps({"grpc_port": 41234, "http_port": 41235, "metrics_port": 41236}))
    assert cli.default_gateway(port_file) == "127.0.0.1:41234"
    assert cli.default_http("127.0.0.1:41234", port_file) == "http://127.0.0.1:41235"


def test_bad_arguments_exit_2_quoting_the_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["top", "--interval-s", "-1"])
    assert e.value.code == 2 and "'-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["status", "--bogus"])
    assert e.value.code == 2 and "--bogus" in capsys.readouterr().err


def test_http_peer_feeds_the_loopback_check() -> None:
    assert is_loopback_peer(http_peer("127.0.0.1"))
    assert is_loopback_peer(http_peer("::1"))
    assert not is_loopback_peer(http_peer("10.1.2.3"))
    assert not is_loopback_peer(http_peer(None))


def test_window_stats() -> None:
    before = {"requests": 10, "ttft_sum": 1.0, "ttft_count": 10, "tbt_sum": 0.5, "tbt_count": 100}
    after = {"requests": 20, "ttft_sum": 3.0, "ttft_count": 20, "tbt_sum": 0.5, "tbt_count": 100}
    assert window_stats(before, after, 2.0) == {"request_rate": 5.0, "ttft_mean_s": 0.2, "tbt_mean_s": None}


def test_grafana_dashboard_shape() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "blitzmesh.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 15
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"blitzmesh_[a-z0-9_]+", target["expr"])
            assert names and all(re.match(r"blitzmesh_(gateway|gm|param|worker)_", n) for n in names), target


def test_a_gateway_url_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--gateway", "http://127.0.0.1:8000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("blitzmesh status: --gateway 'http://127.0.0.1:8000' is not HOST:PORT")
    assert "SDK gRPC API" in err and len(err.splitlines()) == 1
    cli.check_gateway("127.0.0.1:50051")
    cli.check_gateway("[::1]:50051")


def test_dashboard_snapshot_carries_esp_groups_with_their_slices() -> None:
    from blitzmesh import convert
    from blitzmesh.types import EspGroup
    from services.gateway.dashboard import cluster_json

    live = EspGroup("esp-2-s", "s", "m", ("w-1", "w-2"), (0, 64, 120), (), 0.5, ("w-1", "w-2"), True, (64, 60))
    state = ClusterState(esp_groups=(EspGroup("esp-1-r", "r", "m", ("w-1", "w-2"), (0, 64, 120), ("w-3",), 1.5), live))
    group, live_json = cluster_json(convert.cluster_state_to_proto(state))["esp_groups"]
    assert (live_json["holders"], live_json["holder_kv_tokens"]) == (["w-1", "w-2"], [64, 60])
    assert group == {
        "group_id": "esp-1-r",
        "request_id": "r",
        "model": "m",
        "members": ["w-1", "w-2"],
        "bounds": [0, 64, 120],
        "spares": ["w-3"],
        "age_s": 1.5,
        "live": False,
        "holders": [],
        "holder_kv_tokens": [],
    }
    js = (Path(__file__).resolve().parents[2] / "services/gateway/static/app.js").read_text()
    assert "renderEsp(data.esp_groups" in js  # the page draws what the snapshot carries
    assert "g.holder_kv_tokens" in js
