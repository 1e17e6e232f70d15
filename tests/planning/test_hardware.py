"""The device catalogue, a user's devices from TOML, and --cluster's NxDEVICE."""

import pytest

from gpipe.planning.hardware import CATALOGUE, Cluster, load_devices, parse_cluster


def test_the_catalogue_holds_the_devices_the_issue_names():
    assert set(CATALOGUE) == {
        "A100-40GB",
        "A100-80GB",
        "H100-SXM",
        "H100-PCIe",
        "H200",
        "B200",
        "MI300X",
    }
    for device in CATALOGUE.values():
        assert device.peak_flops > 1e14 and device.memory_bytes > 30 * 2**30
        assert device.inter_node_bandwidth < device.intra_node_bandwidth <= device.hbm_bandwidth
        assert 0 < device.gemm_efficiency < 1


def test_a_cluster_is_a_count_and_a_device():
    cluster = parse_cluster("3072xA100-80GB")
    assert cluster == Cluster(3072, CATALOGUE["A100-80GB"]) and cluster.nodes == 384
    assert parse_cluster("16 x h100-sxm").device.name == "H100-SXM"


def test_an_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown device 'V100'; known devices: A100-40GB, "):
        parse_cluster("8xV100")
    with pytest.raises(ValueError, match="NxDEVICE"):
        parse_cluster("A100-80GB")


_L40S = """
[devices.L40S]
peak_tflops = 362
memory_gib = 48
memory_tbps = 0.864
gpus_per_node = 8
intra_node_gbs = 128
inter_node_gbits = 200
gemm_efficiency = 0.6
"""


def test_a_user_device_comes_from_toml(tmp_path):
    path = tmp_path / "devices.toml"
    path.write_text(_L40S)
    devices = load_devices(path)
    assert parse_cluster("64xL40S", devices).device.peak_tflops == 362
    assert devices["L40S"].stack == "megatron-core"


@pytest.mark.parametrize(
    "text, message",
    [
        (_L40S.replace("peak_tflops = 362", "peak_tflops = -1"), "peak_tflops must be a positive"),
        (_L40S.replace("memory_gib = 48\n", ""), r"missing \['memory_gib'\]"),
        (_L40S + "colour = 1\n", r"unknown keys \['colour'\]"),
        (_L40S.replace("0.6", "1.5"), "at most 1"),
        (_L40S + 'stack = "jax"\n', "stack must be one of"),
        ("[devices.X]\npeak_tflops = [", "devices.toml"),
        ("title = 1\n", "expected \\[devices.NAME\\] tables"),
    ],
)
def test_a_bad_device_entry_is_named_in_one_line(tmp_path, text, message):
    path = tmp_path / "devices.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_devices(path)
    assert "\n" not in str(error.value)


def test_a_group_lies_in_a_node_only_where_the_nodes_divide_into_such_groups():
    """Groups of ``span`` neighbouring ranks start at every multiple of ``span``: with 8 GPUs
    a node, groups of 4 stay inside; with 6, the second group of 4 (ranks 4 to 7) spans two
    nodes, and the step waits for it on the network."""
    import dataclasses

    from gpipe.planning.roofline import Link

    eight = CATALOGUE["H100-SXM"]
    six = dataclasses.replace(eight, gpus_per_node=6)
    nvlink, network = eight.intra_node_bandwidth, eight.inter_node_bandwidth
    assert Link.of_group(eight, 4).bandwidth == nvlink
    assert Link.of_group(six, 3).bandwidth == nvlink
    assert Link.of_group(six, 4).bandwidth == network
    assert Link.of_group(eight, 16).bandwidth == network
