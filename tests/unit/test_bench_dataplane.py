"""Pure helpers of the data-plane benchmark: namespace topology plan, shard split, parsers."""

from __future__ import annotations

import os

import pytest

from bench.dataplane.hostmem import proc_status_kib, reported_host_bytes
from bench.dataplane.links import split_groups
from services.mesh.netns import plan


def test_plan_names_addresses_and_shaping() -> None:
    p = plan(3, prefix="bmdp-test", rate_mbit=800)
    assert [h.netns for h in p.hosts] == ["bmdp-test-h0", "bmdp-test-h1", "bmdp-test-h2"]
    assert [h.address for h in p.hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert p.switch == "bmdp-test-sw"
    assert p.link_bytes_per_s == 100e6
    cmds = [" ".join(c) for c in p.setup_commands()]
    # Every host gets its own namespace, a veth whose peer sits on the bridge, and a tbf uplink.
    for h in p.hosts:
        assert f"ip netns add {h.netns}" in cmds
        assert any(c.startswith(f"tc -n {h.netns} qdisc add dev bm0 root tbf rate 800mbit") for c in cmds)
        assert any(f"ip -n {h.netns} link add bm0 type veth peer name p{h.index} netns bmdp-test-sw" == c for c in cmds)
        assert f"ip -n bmdp-test-sw link set p{h.index} master br0" in cmds
    # The switch namespace exists before any veth is pointed at it.
    assert cmds.index("ip netns add bmdp-test-sw") < min(i for i, c in enumerate(cmds) if "type veth" in c)
    # Teardown deletes exactly what setup made.
    assert sorted(c[-1] for c in p.teardown_commands()) == sorted([p.switch, *(h.netns for h in p.hosts)])


def test_a_joined_root_namespace_gets_an_unshaped_port_on_the_switch() -> None:
    assert plan(2, prefix="bmesh-1").root_address is None  # by default nothing touches this namespace
    p = plan(2, prefix="bmesh-12345", subnet="10.78.3", join_root=True)
    assert p.root_address == "10.78.3.254" and p.root_device == "bmesh-12345-r"
    assert len(p.root_device) <= 15  # a Linux interface name
    cmds = [" ".join(c) for c in p.setup_commands()]
    assert "ip link add bmesh-12345-r type veth peer name proot netns bmesh-12345-sw" in cmds
    assert "ip addr add 10.78.3.254/24 dev bmesh-12345-r" in cmds
    assert "ip -n bmesh-12345-sw link set proot master br0" in cmds
    assert not any("qdisc" in c and "bmesh-12345-r" in c for c in cmds)  # unshaped
    # Deleting the switch namespace removes the root end too: teardown is unchanged.
    assert sorted(c[-1] for c in p.teardown_commands()) == sorted([p.switch, *(h.netns for h in p.hosts)])


def test_plan_default_prefix_is_unique_per_process() -> None:
    assert plan(1).hosts[0].netns == f"bmdp-{os.getpid()}-h0"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_hosts": 0}, "n_hosts"),
        ({"n_hosts": 2, "rate_mbit": 0}, "rate_mbit"),
        ({"n_hosts": 2, "subnet": "10.77"}, "subnet"),
        ({"n_hosts": 2, "prefix": "bad name"}, "prefix"),
    ],
)
def test_plan_rejects_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan(**kwargs)


def test_split_groups_is_disjoint_balanced_and_ordered() -> None:
    sizes = [("embed", 50)] + [(f"layers.{i}", 100) for i in range(32)] + [("head", 50)]
    for g in (1, 2, 3, 4):
        shards = split_groups(sizes, g)
        names = [n for s in shards for n in s]
        assert sorted(names) == sorted(n for n, _ in sizes)  # every group once
        order = [n for n, _ in sizes]
        for s in shards:
            assert s == sorted(s, key=order.index)  # layer order kept inside a shard
        loads = [sum(dict(sizes)[n] for n in s) for s in shards]
        assert max(loads) - min(loads) <= 100  # within one group of each other
    with pytest.raises(ValueError):
        split_groups(sizes[:2], 3)
    with pytest.raises(ValueError):
        split_groups(sizes, 0)


def test_reported_host_bytes_parses_the_gauge() -> None:
    text = (
        "# HELP blitzmesh_param_host_bytes Bytes of parameters\n"
        "# TYPE blitzmesh_param_host_bytes gauge\n"
        "blitzmesh_param_host_bytes 4.02729984e+08\n"
        "blitzmesh_param_models 1.0\n"
    )
    assert reported_host_bytes(text) == 402729984
    with pytest.raises(ValueError):
        reported_host_bytes("blitzmesh_param_models 1.0\n")


def test_proc_status_of_this_process() -> None:
    st = proc_status_kib(os.getpid())
    assert st["VmRSS"] > 0 and st["RssAnon"] > 0 and st["VmHWM"] >= st["VmRSS"]


def test_targets_compare_like_for_like_and_report_the_stricter_ratios() -> None:
    from bench.dataplane.__main__ import targets

    results = {
        "ucx_perftest_gbps": 10.0,
        "ucx_perftest_all_tls_gbps": 5.0,
        "one_hop_transport_gbps": {"ucx": 9.0},
        "one_hop_gbps": {"ucx": 4.0},
        "chain_fill_s": {"1": 6.0, "4": 7.0},
        "host_bytes_o1": {"1": 100, "4": 100},
        "host_bytes_per_host": {"1": 100, "4": 400},
    }
    t = targets(results)
    assert t["ucx_transport_over_ucx_perftest"] == {"value": 0.9, "target": ">= 0.70", "met": True}
    assert t["ucx_pull_over_ucx_perftest"]["value"] == 0.4 and t["ucx_pull_over_ucx_perftest"]["met"] is False
    assert t["ucx_pull_over_ucx_perftest_default"]["value"] == 0.8
    assert t["chain_n4_over_n1"]["met"] is True  # 7/6 = 1.17 <= 1.3
    assert t["host_bytes_o1_over_per_host_H4"]["value"] == 0.25
    # Without a ucx_perftest figure there is no verdict, not a failed one.
    assert targets({"one_hop_gbps": {"ucx": 4.0}})["ucx_transport_over_ucx_perftest"]["met"] is None
