"""A real out-of-tree plugin package, installed with pip, is listed and used by a run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import NO_ISOLATION, python_path

ROOT = Path(__file__).resolve().parents[1]


def test_pip_installed_plugin_is_listed_and_used(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *NO_ISOLATION, "--target",
                    str(site), str(ROOT / "examples" / "custom_plugin")], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": python_path(site)}
    env.pop("RLPIPE_DISABLE_PLUGIN_AUTOLOAD", None)
    rlpipe = [sys.executable, "-m", "rlpipe.cli"]

    listed = subprocess.run(rlpipe + ["plugins"], env=env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in listed.stdout.splitlines()}
    assert rows[("rewards", "keyword")] == ["rlpipe-example-plugin", "0.1.0", "ok"]
    assert rows[("advantages", "reward_to_go")] == ["rlpipe-example-plugin", "0.1.0", "ok"]

    raw = yaml.safe_load((ROOT / "examples" / "tiny" / "config.yaml").read_text())
    raw["models"]["actor"]["path"] = str(ROOT / "examples" / "tiny" / "model")
    raw["data"]["prompts"] = str(ROOT / "examples" / "tiny" / "prompts.txt")
    raw["rewards"] = [{"name": "keyword", "weight": 2.0, "word": "the"}, {"name": "length"}]
    raw["advantage"] = {"name": "reward_to_go", "gamma": 1.0}
    raw["run"].update(steps=2, output_dir=str(tmp_path / "run"))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    run = subprocess.run(rlpipe + ["run", str(config), "--no-progress"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("reward/keyword" in r and "reward/length" in r for r in rows)
    assert all(abs(r["reward/score"] - 2.0 * r["reward/keyword"] - r["reward/length"]) < 1e-5
               for r in rows)
    assert not any(k.startswith("value/") for k in rows[0])  # critic-free estimator: no critic trained

    # without autoload only built-ins remain, and selecting the plugin names what is available
    env["RLPIPE_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    off = subprocess.run(rlpipe + ["config", str(config)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert off.returncode == 2
    assert off.stderr.strip() == ("error: unknown advantage plugin 'reward_to_go'; "
                                  "available: gae, grpo, reinforce_pp, rloo, turn")
