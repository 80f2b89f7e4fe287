"""benchmarks/host/bench_op_host.py in a few calls: every reference it compares with is measured, and an op whose
public entry is an nn.Module gets the reference called through a module too."""

from __future__ import annotations

import pytest

from benchmarks.host import bench_op_host


def test_rows_carry_each_reference(triton_device):
    pytest.importorskip("triton")
    rows = {r["op"]: r for r in bench_op_host.measure(["FusedLayerNorm", "fused_rope"], calls=2, repeats=1)}
    assert set(rows) >= {"FusedLayerNorm", "fused_rope"}
    for name, row in rows.items():
        assert "error" not in row, row
        for key in ("fwd_us", "fwd_bwd_us", "fwd_per_job", "fwd_bwd_per_job", "fwd_bwd_per_plain"):
            assert row[key] > 0, (name, key)
    assert rows["FusedLayerNorm"]["fwd_bwd_per_mjob"] > 0  # a module entry
    assert "fwd_bwd_per_mjob" not in rows["fused_rope"]  # a function entry
    assert rows["FusedLayerNorm"]["fwd_launches"] == 1 and rows["FusedLayerNorm"]["fwd_bwd_launches"] == 3
    lines = bench_op_host.table(list(rows.values())).splitlines()
    assert "same-job module" in lines[0]
    assert all(line.count("|") == lines[0].count("|") for line in lines)
