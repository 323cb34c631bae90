"""`pdcluster plan --shards`: one rank's share of the weights, printed from engine/model/shards.py's plan."""

from __future__ import annotations

import json

from cluster.shards import main
from engine.model.config import get_preset
from engine.model.shards import shard_plan


def test_json_lists_every_tensor_with_the_plans_bytes(capsys) -> None:  # noqa: ANN001
    assert main(["--shards", "--model", "kimi-k3.1-mini", "--parallel", "tp2", "--rank", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = shard_plan(get_preset("kimi-k3.1-mini"), 2, 1)
    assert out["rank_bytes"] == plan.rank_bytes == sum(t["rank_bytes"] for t in out["tensors"])
    assert out["rank_bytes"] == out["replicated_bytes"] + out["sharded_bytes"] // 2
    assert {t["kind"] for t in out["tensors"]} == {"attention_head", "kda_head", "expert", "output_rows",
                                                   "replicated"}


def test_table_groups_layers_and_totals(capsys) -> None:  # noqa: ANN001
    assert main(["--shards", "--model", "kimi-k3.1-pro", "--parallel", "dcp8"]) == 0
    text = capsys.readouterr().out
    assert "layers.{i}.mixer.wq_b.weight" in text and "attention_head" in text
    assert "rank 0 of dcp8" in text and "replicated + sharded / 8" in text


def test_uneven_split_exits_2_naming_it(capsys) -> None:  # noqa: ANN001
    assert main(["--shards", "--model", "kimi-k3.1-mini", "--parallel", "tp3"]) == 2
    assert "do not split over 3 ranks" in capsys.readouterr().err
