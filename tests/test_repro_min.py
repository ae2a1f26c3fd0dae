"""scripts/repro_min.py on the CPU: its model configs set up the bug's precondition (vLLM's own grouping)."""

import json
import subprocess
import sys

from dflash_lab import kvgroups


def test_repro_configs_split_the_target_attention_over_two_groups(tmp_path, root):
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--write-configs-only", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    t = json.load(open(tmp_path / "target" / "config.json"))["text_config"]
    d = json.load(open(tmp_path / "draft" / "config.json"))
    layers = kvgroups.hybrid_layers(num_layers=t["num_hidden_layers"], full_attention_interval=t["full_attention_interval"],
                                    target_attn=(t["num_key_value_heads"], t["head_dim"]),
                                    draft_layers=d["num_hidden_layers"],
                                    draft_attn=(d["num_key_value_heads"], d["head_dim"]))
    reusers = kvgroups.metadata_reusers(kvgroups.groups(layers))
    assert [[kvgroups.layer_index(x) for x in g["layers"]] for g in reusers] == [[7]]
    assert max(d["dflash_config"]["target_layer_ids"]) < t["num_hidden_layers"]


def test_repro_refuses_bad_arguments(root):
    r = subprocess.run([sys.executable, str(root / "scripts" / "repro_min.py"), "--concurrency", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must be >= 2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
