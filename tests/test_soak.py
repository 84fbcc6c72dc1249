"""A short soak (agent/bench/soak.py) with the embedded model: the budget holds, the archive stays within
its disk bound by really removing segments, and the report carries all four checks. Timings and RSS are
reported, not asserted: they are the benchmark's to judge."""

import pytest
import torch

from agent.bench.soak import SoakConfig, render_soak, run_soak

MIB = 2**20


@pytest.fixture
def one_thread():
    """Many small forwards: a second torch thread saves little, and on a shared 2-core CPU its spinning
    made this test four times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_short_soak_keeps_budget_and_disk_bound(embedded, one_thread):
    config = SoakConfig(turns=50, budget=256, memory_cap_bytes=2 * MIB, disk_cap_bytes=8 * MIB, save_every=20,
                        checkpoint_every=10)
    result = run_soak(embedded, config, lambda message: None)

    assert set(result["checks"]) == {"kv", "rss", "archive", "ttft"}
    kv, archive = result["kv"], result["archive"]
    assert kv["max_tokens"] <= config.budget
    assert kv["max_held_bytes"] <= kv["budget_bytes"] == config.budget * embedded.kv_bytes_per_token()
    assert result["checks"]["kv"] and result["checks"]["archive"]
    assert archive["max_over_bound_bytes"] <= 0
    assert archive["max_live_kv_file_bytes"] > config.disk_cap_bytes // 2  # the cap was reached, not idle
    assert archive["segments_held"] > 0 and archive["segments_removed"] > 0

    series = result["series"]
    assert [row["turn"] for row in series] == list(range(10, 51, 10))
    assert all(row["kv_tokens"] <= config.budget for row in series)
    assert all(row["archive_memory_bytes"] <= config.memory_cap_bytes for row in series)
    saved = [row for row in series if row["turn"] % config.save_every == 0]
    assert saved and all(row["removed_file_bytes"] == 0 for row in saved)  # removed files go at the save
    assert max(row["removed_file_bytes"] for row in series) > 0  # and wait for it in between

    rss, ttft = result["rss"], result["ttft"]
    assert rss["warmup_end_bytes"] > 0 and rss["max_bytes"] >= rss["end_bytes"] > 0 and "growth" in rss
    assert ttft["early_ms_p50"] > 0 and ttft["late_ms_p50"] > 0 and ttft["ratio"] > 0
    text = "\n".join(render_soak(result))
    for check in ("kv (", "rss (", "archive (", "ttft ("):
        assert check in text
