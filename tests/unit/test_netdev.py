"""The network interface UCX is given: the one holding the advertised address (netdev.py)."""

from services.dataplane.netdev import net_device_for

SWARM_TASK = {"lo": "127.0.0.1", "eth0": "10.0.1.7", "eth1": "172.22.0.3"}  # overlay, docker_gwbridge


def test_the_interface_holding_the_advertised_address() -> None:
    assert net_device_for(["10.0.1.7"], SWARM_TASK) == "eth0"
    assert net_device_for(["192.0.2.9", "172.22.0.3"], SWARM_TASK) == "eth1"


def test_no_choice_for_loopback_or_a_foreign_address() -> None:
    assert net_device_for(["127.0.0.1"], SWARM_TASK) is None  # a same-host mesh: UCX keeps all
    assert net_device_for(["0.0.0.0"], SWARM_TASK) is None
    assert net_device_for(["10.96.0.10"], SWARM_TASK) is None  # a NAT'd or service address
    assert net_device_for([], SWARM_TASK) is None
