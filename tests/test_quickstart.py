"""The README's first command: the default experiment through the real CLI."""

import json

from helpers import plait_cmd


def test_quickstart_trains_and_writes_its_run_directory(tmp_path):
    run_dir = tmp_path / "qs"
    # XLA's warnings shown and the step compiled here, not found in the tests' cache: the
    # first command a user runs prints plait's lines, not the SPMD partitioner's (it
    # warned of a gather it could not partition until the position table was pinned
    # whole for the lookup, models.gpt)
    proc = plait_cmd("train", "experiments/quickstart.toml", "--run-dir", str(run_dir),
                     "--steps", "60", "--set", "checkpoint.every_steps=30",
                     env={"TF_CPP_MIN_LOG_LEVEL": "1",
                          "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "[SPMD]" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert "mesh data=2,fsdp=2,tensor=2 (8 cpu devices)" in proc.stdout
    assert "done at step 60/60" in proc.stdout
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40, 50, 60]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert records[-1]["mfu"] is None  # CPU: no published peak
    assert all(r["tokens_per_s"] > 0 for r in records[1:])
    config = (run_dir / "config.toml").read_text()
    assert "[mesh]" in config and "steps = 60" in config
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["30", "60"]
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"train/loss" in events[0].read_bytes()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 60 and summary["steps_run"] == 60

    # The same command again: nothing to do, nothing lost.
    again = plait_cmd("train", "experiments/quickstart.toml", "--run-dir", str(run_dir),
                      "--steps", "60")
    assert again.returncode == 0 and "already trained to step 60" in again.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == len(records)
    assert not list(run_dir.glob("config.step*.toml"))
    # ... and no empty TensorBoard event file.
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")) == events
