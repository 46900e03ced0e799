"""The price of a step run by one process per GPU: the all-reduce over a fabric, and buckets
overlapping backward (:mod:`autopar.schedule.world`), checked exactly on small fabrics."""

import pytest

from autopar.machine.fabric import Fabric
from autopar.machine.model import LinkProfile
from autopar.machine.presets import preset_fabric
from autopar.schedule.world import (
    all_reduce_s,
    predict_sharded,
    predict_world,
    should_shard,
    state_tensors,
)

NVLINK = LinkProfile(1e-6, 100e9)  # 1 us, 100 GB/s
NIC = LinkProfile(10e-6, 10e9)


def test_one_node_is_a_ring():
    # 2 (g-1)/g of the bytes over NVLink, in two phases of one latency each
    assert all_reduce_s(400e6, Fabric(4, 1, NVLINK)) == pytest.approx(2 * (1e-6 + 3e-3))


def test_two_nodes_add_each_gpus_slice_over_its_own_nic():
    # inside: as one node; between: 2 (n-1)/n of a GPU's 1/g slice over its NIC
    inside = 2 * (1e-6 + 3e-3)
    between = 2 * (10e-6 + 0.5 * 100e6 / 10e9)
    assert all_reduce_s(400e6, Fabric(4, 2, NVLINK, NIC)) == pytest.approx(inside + between)


def test_one_rank_or_no_gradient_costs_nothing_more():
    got = predict_world(10e-3, 1e-3, 0, Fabric(4, 1, NVLINK))
    assert (got.step_s, got.comm_s, got.buckets) == (10e-3, 0.0, 0)


def test_buckets_hide_behind_backward_but_the_last():
    """Two buckets of 100 MB on 2 GPUs: two phases of 1 us + 0.5 ms each, 1.002 ms.
    Forward 3 ms, backward 6 ms (2/3 of 9 ms); bucket 1 is full at 6 ms, bucket 2 at 9 ms:
    the second ends at 9 + 1.002 ms, so 1.002 ms is exposed, then the 1 ms update.

        compute |--fwd 3--|------bwd 6------|
        comm                     |b1|       |b2|
                                 6          9  10.002 -> + update 1 = 11.002
    """
    got = predict_world(10e-3, 1e-3, 200e6, Fabric(2, 1, NVLINK), bucket_bytes=100e6)
    assert got.buckets == 2
    assert got.exposed_s == pytest.approx(1.002e-3)
    assert got.step_s == pytest.approx(11.002e-3)


def test_a_slow_link_queues_the_buckets():
    """Each bucket takes 10 ms, longer than backward: they queue on the one lane."""
    slow = LinkProfile(0.0, 10e9)  # 2 GPUs: 100 MB over 10 GB/s = 10 ms a bucket
    got = predict_world(10e-3, 1e-3, 200e6, Fabric(2, 1, slow), bucket_bytes=100e6)
    # b1 6..16, b2 16..26: exposed 26 - 9 = 17 ms
    assert got.exposed_s == pytest.approx(17e-3)


def test_the_two_node_preset_has_a_nic_per_gpu():
    fabric = preset_fabric("2xh200x8")
    assert (fabric.gpus, fabric.nodes, fabric.ranks) == (8, 2, 16)
    assert fabric.inter.bandwidth == 50e9  # 400 Gb/s
    assert preset_fabric("h200x8").inter is None
    assert preset_fabric("h200x8", gpus=4).ranks == 4
    with pytest.raises(ValueError, match="has 8 GPUs, not 9"):
        preset_fabric("h200x8", gpus=9)


def test_sharded_gathers_twice_and_scatters_once_behind_the_compute():
    """200 MB of parameters in 4 blocks on 2 GPUs: an all-gather (or a reduce-scatter) is one
    phase, 1 us + 1 ms. Forward 3 ms hides the gather but its first block's 0.25 ms; backward
    6 ms hides the second gather and the scatter but the last block's 0.25 ms; each rank
    updates half the parameters (1 ms -> 0.5 ms).

        fwd  |b1|---------3---------|
        bwd                         |--------6--------|b4|
    """
    got = predict_sharded(10e-3, 1e-3, 200e6, Fabric(2, 1, NVLINK), units=4)
    gather = 1e-6 + 1e-3
    assert got.comm_s == pytest.approx(3 * gather)
    assert got.exposed_s == pytest.approx(gather / 4 + gather / 4)
    assert got.step_s == pytest.approx(9e-3 + gather / 2 + 0.5e-3)
    assert got.update_s == pytest.approx(0.5e-3)


def test_sharded_on_a_slow_link_exposes_what_the_compute_cannot_hide():
    slow = LinkProfile(0.0, 10e9)  # 2 GPUs: 200 MB -> 10 ms a gather or scatter
    got = predict_sharded(10e-3, 1e-3, 200e6, Fabric(2, 1, slow), units=2)
    # forward: 5 ms first block, then 5 more against 3 ms of compute: 5 + 2
    # backward: 20 ms against 6 ms: 14, then half the last scatter: 5
    assert got.exposed_s == pytest.approx(7e-3 + 14e-3 + 5e-3)


def test_one_rule_shards_a_replica_over_half_a_gpu():
    assert not should_shard(40e9, 80e9) and should_shard(40.1e9, 80e9)
    assert (state_tensors("AdamW"), state_tensors("SGD", momentum=False),
            state_tensors("SGD"), state_tensors("Adagrad")) == (2, 0, 1, 1)
