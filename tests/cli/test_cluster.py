"""cluster.yaml: validation errors (one line, naming node and field), capacity, worker slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.ops.cluster import (
    RESERVE_FACTOR,
    TOTAL,
    Cluster,
    MemoryType,
    capacity_table,
    cli_show,
    cli_validate,
    format_table,
    is_loopback_host,
    load_cluster,
    parse_cluster,
    workers_for_node,
)
from shoal.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def gpu(uuid: str = "GPU-a", vram: int = 24000, mem: str = "discrete", **kw) -> dict:
    return {"uuid": uuid, "type": "RTX 4090", "vram_mb": vram, "memory_type": mem, **kw}


def cpu_node(name: str = "cpu-1", cores: int = 4, **kw) -> dict:
    return {"name": name, "transport": "local", "cpu_cores": cores, **kw}


def bad(data: object) -> str:
    """The ConfigError message for ``data``; asserts it is one line."""
    with pytest.raises(ConfigError) as info:
        parse_cluster(data, "c.yaml")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("c.yaml: ")
    assert info.value.exit_code == 2
    return msg


# --- validation errors ------------------------------------------------------------------------


def test_no_nodes() -> None:
    assert "no nodes" in bad({"nodes": []})
    assert "no nodes" in bad({})
    with pytest.raises(ConfigError, match="empty"):
        parse_cluster(None, "c.yaml")


def test_not_a_mapping() -> None:
    assert "expected a mapping" in bad(["a", "b"])


def test_duplicate_node_names() -> None:
    msg = bad({"nodes": [cpu_node("n1"), cpu_node("n2"), cpu_node("n1")]})
    assert "duplicate node name 'n1'" in msg


def test_zero_capacity_max_workers_zero() -> None:
    msg = bad({"nodes": [cpu_node("n1", max_workers=0)]})
    assert msg == "c.yaml: invalid: nodes[n1]: zero capacity: max_workers is 0"


def test_zero_capacity_no_cpu_no_gpu() -> None:
    msg = bad({"nodes": [cpu_node("ok"), {"name": "empty", "cpu_cores": 0}]})
    assert msg == "c.yaml: invalid: nodes[empty]: zero capacity: no gpus and cpu_cores is 0"
    assert "no gpus" in bad({"nodes": [{"name": "bare"}]})


def test_gpu_with_zero_vram() -> None:
    msg = bad({"nodes": [{"name": "g", "gpus": [gpu("GPU-a"), gpu("GPU-b", vram=0)]}]})
    assert msg == "c.yaml: invalid: nodes[g].gpus[1].vram_mb: GPU has zero VRAM (vram_mb must be > 0)"


def test_duplicate_gpu_uuid_on_a_node() -> None:
    msg = bad({"nodes": [{"name": "g", "gpus": [gpu("GPU-a"), gpu("GPU-b"), gpu("GPU-a")]}]})
    assert msg == "c.yaml: invalid: nodes[g]: duplicate GPU uuid 'GPU-a': each GPU may be listed once"


def test_same_gpu_uuid_on_two_nodes_is_not_this_check() -> None:
    # the rule is per node; two nodes each listing their own GPU-a is accepted
    parse_cluster({"nodes": [{"name": "a", "gpus": [gpu("GPU-a")]}, {"name": "b", "gpus": [gpu("GPU-a")]}]})


@pytest.mark.parametrize(
    "host",
    ["localhost", "LOCALHOST", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "0.0.0.0", "::ffff:127.0.0.1", "foo.localhost"],
)
def test_ssh_to_loopback_is_refused(host: str) -> None:
    msg = bad({"nodes": [{"name": "far", "transport": "ssh", "host": host, "cpu_cores": 2}]})
    assert msg.startswith("c.yaml: invalid: nodes[far]: transport ssh to loopback host")
    assert "use transport: local" in msg


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "::1"])
def test_local_transport_on_loopback_is_fine(host: str) -> None:
    parse_cluster({"nodes": [cpu_node("here", host=host)]})


@pytest.mark.parametrize("host", ["gpu-box", "10.0.0.7", "gpu-box.example.internal", "fe80::1", "128.0.0.1", "localhostess"])
def test_ssh_to_remote_hosts_is_accepted(host: str) -> None:
    assert not is_loopback_host(host)
    parse_cluster({"nodes": [{"name": "far", "transport": "ssh", "host": host, "cpu_cores": 2}]})


def test_ssh_needs_a_host() -> None:
    assert bad({"nodes": [{"name": "far", "transport": "ssh", "cpu_cores": 2}]}).endswith(
        "nodes[far]: transport ssh needs a host"
    )


@pytest.mark.parametrize("host", ["-oProxyCommand=sh", "user@box", "two words", ""])
def test_host_that_ssh_could_misread_is_refused(host: str) -> None:
    msg = bad({"nodes": [{"name": "far", "transport": "ssh", "host": host, "cpu_cores": 2}]})
    assert "nodes[far].host: not a host name or address" in msg


def test_user_that_ssh_could_misread_is_refused() -> None:
    msg = bad({"nodes": [{"name": "far", "transport": "ssh", "host": "box", "user": "-oX", "cpu_cores": 1}]})
    assert "nodes[far].user:" in msg


def test_field_errors_name_node_and_field_without_values() -> None:
    msg = bad(
        {
            "nodes": [
                {"name": "g", "gpus": [gpu(mem="weird")], "password": "hunter2"},
                {"name": "c", "cpu_cores": -1},
                {"name": "bad name!", "cpu_cores": 1},
                {"name": "t", "transport": "telnet", "cpu_cores": 1},
            ]
        }
    )
    assert "nodes[g].gpus[0].memory_type: Input should be 'discrete' or 'unified'" in msg
    assert "nodes[g].password: unknown field" in msg
    assert "nodes[c].cpu_cores:" in msg
    assert "nodes[2].name:" in msg  # an invalid name is not used as a label
    assert "nodes[t].transport:" in msg
    assert "hunter2" not in msg  # input values are never echoed


def test_duplicate_names_are_labelled_by_index() -> None:
    msg = bad({"nodes": [cpu_node("x"), {"name": "x", "cpu_cores": -1}]})
    assert "nodes[1].cpu_cores:" in msg


def test_a_job_spec_is_not_a_cluster_file() -> None:
    msg = bad(yaml.safe_load((ROOT / "examples" / "job.yaml").read_text()))
    assert msg.startswith("c.yaml: not a cluster file: no 'nodes' list (found: name, entrypoint,")


def test_unknown_top_level_field() -> None:
    assert "nodez: unknown field" in bad({"nodes": [cpu_node()], "nodez": []})


# --- loading files -----------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cannot read cluster file .*nope\.yaml: No such file"):
        load_cluster(tmp_path / "nope.yaml")


def test_bad_yaml(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("nodes: [a: b: c]\nsecret: s3cr3t\n")
    with pytest.raises(ConfigError) as info:
        load_cluster(p)
    msg = str(info.value)
    assert msg.startswith(f"{p}: not valid YAML at line 1, column")
    assert "\n" not in msg


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_cluster(tmp_path)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"nodes": [cpu_node("a", max_workers=0)]}))
    with pytest.raises(ConfigError, match=rf"^{p}: invalid: nodes\[a\]: zero capacity"):
        load_cluster(p)


# --- capacity and worker slots -----------------------------------------------------------------


def test_example_cluster_file() -> None:
    c = load_cluster(ROOT / "examples" / "cluster.yaml")
    kinds = {n.name: (n.transport.value, bool(n.gpus)) for n in c.nodes}
    assert ("local", False) in kinds.values() and ("ssh", True) in kinds.values()


def test_usable_vram_reserve_factor() -> None:
    assert RESERVE_FACTOR == {MemoryType.discrete: 0.85, MemoryType.unified: 0.60}
    c = parse_cluster(
        {"nodes": [{"name": "g", "gpus": [gpu("GPU-a", 10000), gpu("GPU-b", 10000, "unified")], "cpu_cores": 8}]}
    )
    node_row, total = capacity_table(c)
    assert node_row.usable_vram_per_gpu_mb == (8500, 6000)
    assert node_row.usable_vram_mb == 14500
    assert total.node == TOTAL and total.usable_vram_mb == 14500


def test_gpu_node_one_worker_per_gpu_capped_by_max_workers() -> None:
    c = parse_cluster(
        {
            "nodes": [
                {"name": "g3", "gpus": [gpu("GPU-a"), gpu("GPU-b"), gpu("GPU-c")], "cpu_cores": 64},
                {"name": "g3cap", "gpus": [gpu("GPU-a"), gpu("GPU-b"), gpu("GPU-c")], "max_workers": 2},
                {"name": "noid", "gpus": [{"vram_mb": 8000}, {"vram_mb": 8000}]},
            ]
        }
    )
    assert [s.device for s in workers_for_node(c, "g3")] == ["cuda:GPU-a", "cuda:GPU-b", "cuda:GPU-c"]
    slots = workers_for_node(c, "g3cap")
    assert [s.device for s in slots] == ["cuda:GPU-a", "cuda:GPU-b"]
    assert [s.slot for s in slots] == [0, 1] and all(s.node == "g3cap" for s in slots)
    assert slots[0].usable_vram_mb == int(24000 * 0.85)
    assert [s.device for s in workers_for_node(c, "noid")] == ["cuda:0", "cuda:1"]


def test_cpu_node_min_of_max_workers_and_cores() -> None:
    c = parse_cluster(
        {"nodes": [cpu_node("a", cores=4), cpu_node("b", cores=4, max_workers=2), cpu_node("c", cores=2, max_workers=8)]}
    )
    assert [s.device for s in workers_for_node(c, "a")] == ["cpu"] * 4
    assert len(workers_for_node(c, "b")) == 2
    assert len(workers_for_node(c, "c")) == 2


def test_unknown_node_is_a_config_error() -> None:
    c = parse_cluster({"nodes": [cpu_node("a")]})
    with pytest.raises(ConfigError, match="no node named 'zz' in the cluster \\(nodes: a\\)"):
        workers_for_node(c, "zz")


# --- property: totals are the sums over nodes ------------------------------------------------

_gpu_st = st.builds(
    lambda vram, mem: {"vram_mb": vram, "memory_type": mem, "type": "g"},
    st.integers(1, 200_000),
    st.sampled_from(["discrete", "unified"]),
)


@st.composite
def clusters(draw) -> dict:
    n = draw(st.integers(1, 6))
    nodes = []
    for i in range(n):
        gpus = draw(st.lists(_gpu_st, max_size=4))
        for j, g in enumerate(gpus):
            if draw(st.booleans()):
                g["uuid"] = f"GPU-{i}-{j}"
        cores = draw(st.integers(0 if gpus else 1, 128))
        node = {"name": f"n{i}", "cpu_cores": cores, "ram_mb": draw(st.integers(0, 10**6)), "gpus": gpus}
        if draw(st.booleans()):
            node["max_workers"] = draw(st.integers(1, 16))
        if draw(st.booleans()):
            node.update(transport="ssh", host=f"host{i}.example", user="shoal")
        nodes.append(node)
    return {"nodes": nodes}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_capacity_totals_equal_sums_over_nodes(data: dict) -> None:
    c = parse_cluster(data)
    rows = capacity_table(c)
    node_rows, total = rows[:-1], rows[-1]
    assert [r.node for r in node_rows] == [n.name for n in c.nodes] and total.node == TOTAL
    for field in ("workers", "gpus", "usable_vram_mb", "cpu_cores", "ram_mb"):
        assert getattr(total, field) == sum(getattr(r, field) for r in node_rows), field
    for raw, row in zip(data["nodes"], node_rows):
        assert row.usable_vram_mb == sum(row.usable_vram_per_gpu_mb)
        assert all(0 <= u <= g["vram_mb"] for u, g in zip(row.usable_vram_per_gpu_mb, raw["gpus"]))
        slots = workers_for_node(c, row.node)
        assert len(slots) == row.workers >= 1
        devices = [s.device for s in slots]
        if raw["gpus"]:
            assert len(set(devices)) == len(devices) and all(d.startswith("cuda:") for d in devices)
            assert row.workers == min(len(raw["gpus"]), raw.get("max_workers", 10**9))
        else:
            assert set(devices) == {"cpu"}
            assert row.workers == min(raw["cpu_cores"], raw.get("max_workers", 10**9))
    # the table renders every node plus the total, columns aligned
    lines = format_table(rows).splitlines()
    assert len(lines) == len(rows) + 1


def test_round_trip_through_a_model_dump() -> None:
    c = load_cluster(ROOT / "examples" / "cluster.yaml")
    assert Cluster.model_validate(c.model_dump(mode="json")) == c


# --- CLI helpers -------------------------------------------------------------------------------


def test_cli_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_validate(ROOT / "examples" / "cluster.yaml") == 0
    out, err = capsys.readouterr()
    assert "ok: 2 node(s)" in out and err == ""


def test_cli_validate_error_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"nodes": [{"name": "x", "transport": "ssh", "host": "127.0.0.1", "cpu_cores": 1}]}))
    assert cli_validate(p) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("shoal: ") and err.count("\n") == 1 and "Traceback" not in err
    assert cli_show(tmp_path / "missing.yaml") == 2


def test_cli_show_aligned_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_show(ROOT / "examples" / "cluster.yaml") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["NODE", "TRANSPORT", "ADDRESS"]
    assert lines[-1].startswith(TOTAL)
    # right-aligned numeric columns: every row ends at the same column
    assert len({len(line) for line in lines}) == 1
    # the WORKERS column lines up across rows
    col = lines[0].index("WORKERS") + len("WORKERS")
    assert all(line[col - 1].isdigit() for line in lines[1:])
