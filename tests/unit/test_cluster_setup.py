"""What a cluster is made of, before anything starts: server URL lists and node layout."""

import pytest

from reach._urls import check_servers
from reach.testing import NatsCluster


def test_a_nats_url_may_name_every_node_of_a_cluster():
    assert check_servers("nats://a:4222") == ["nats://a:4222"]
    assert check_servers("nats://a:1, nats://b:2,nats://c:3,") == [
        "nats://a:1",
        "nats://b:2",
        "nats://c:3",
    ]


def test_cluster_nodes_get_names_ports_and_stores_of_their_own(tmp_path):
    cluster = NatsCluster(3, port=4222, data_dir=tmp_path)
    assert cluster.names == ["reach-1", "reach-2", "reach-3"]
    assert [n.port for n in cluster.nodes] == [4222, 4223, 4224]
    assert len({n.store_dir for n in cluster.nodes}) == 3
    assert all(n.store_dir.is_relative_to(tmp_path) for n in cluster.nodes)
    assert cluster.node("reach-2") is cluster.nodes[1]
    assert cluster.urls == ""  # nothing started, nothing to connect to
    cluster.close()  # closing what never started is harmless


def test_a_cluster_needs_a_node():
    with pytest.raises(ValueError, match="at least one node"):
        NatsCluster(0)
